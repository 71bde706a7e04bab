"""Step-wise learning-rate schedules: the LR moves on every optimizer step, not once
per epoch, so short runs and wall-clock budgets get a smooth warm-up and decay.

The schedule's math is the closed form of torch's schedulers (``LinearLR`` warm-up,
``CosineAnnealingLR``, ``StepLR``, ``MultiStepLR``, ``ExponentialLR``, ``OneCycleLR``'s
cosine phases), written as a function of continuous time so that it can be evaluated
at any point of a run measured in epochs, batches, samples, seconds or fractions.
"""

from __future__ import annotations

import math
import warnings
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slipstream import (
    Algorithm,
    ConfigError,
    Duration,
    State,
    check_plugin_options,
    hookimpl,
    parse_duration_option,
    plugin_option,
)

SCHEDULES = (
    "constant",
    "step",
    "multistep",
    "exponential",
    "warmup_cosine",
    "warmup_linear",
    "onecycle",
)
INTERVALS = ("step", "epoch")
# The config keys holding durations, and the schedules that read each one.
_DURATION_KEYS = {
    "warmup": ("warmup_cosine", "warmup_linear"),
    "step_size": ("step", "exponential"),
    "milestones": ("multistep",),
}


@dataclass
class StepwiseLRConfig:
    schedule: str = plugin_option("warmup_cosine", choices=SCHEDULES)
    # step: new LR every optimizer step; epoch: once per epoch
    interval: str = plugin_option("step", choices=INTERVALS)
    warmup: str = "0.05dur"  # warmup_cosine / warmup_linear: linear warm-up length
    # the warm-up starts at this fraction of each group's LR
    warmup_start_factor: float = plugin_option(0.1, low=0, high=1)
    # warmup_cosine / warmup_linear: the LR at the end of the run
    min_lr: float = plugin_option(0.0, low=0)
    step_size: str = "1ep"  # step: decay period; exponential: the time gamma applies to
    milestones: list[str] = field(default_factory=lambda: ["0.5dur", "0.75dur"])  # multistep
    # step / multistep / exponential: the decay factor
    gamma: float = plugin_option(0.1, low=0, low_open=True)
    # onecycle: fraction of the run spent rising
    pct_start: float = plugin_option(0.3, low=0, high=1, low_open=True, high_open=True)
    # onecycle: starting LR = lr / div_factor
    div_factor: float = plugin_option(25.0, low=0, low_open=True)
    # onecycle: final LR = starting LR / final_div_factor
    final_div_factor: float = plugin_option(1e4, low=0, low_open=True)

    def __post_init__(self) -> None:
        check_plugin_options(self)
        parse_duration_option(StepwiseLR.name, "warmup", self.warmup)
        parse_duration_option(StepwiseLR.name, "step_size", self.step_size, positive=True)
        for milestone in self.milestones:
            parse_duration_option(StepwiseLR.name, "milestones", milestone)


@dataclass(frozen=True)
class _Spans:
    """The config's durations as numbers in the unit of the schedule's clock."""

    warmup: float = 0.0
    step_size: float = 1.0
    milestones: tuple[float, ...] = ()


def _spans(cfg: StepwiseLRConfig, convert: Callable[[str, Duration], float]) -> _Spans:
    # Only the durations the schedule reads are converted, so an unused default
    # (step_size=1ep) never fails a run bounded by wall clock.
    used = {key for key, schedules in _DURATION_KEYS.items() if cfg.schedule in schedules}
    return _Spans(
        warmup=convert("warmup", Duration.parse(cfg.warmup)) if "warmup" in used else 0.0,
        step_size=convert("step_size", Duration.parse(cfg.step_size)) if "step_size" in used else 1.0,
        milestones=tuple(sorted(convert("milestones", Duration.parse(m)) for m in cfg.milestones))
        if "milestones" in used
        else (),
    )


def _cosine(start: float, end: float, pct: float) -> float:
    """From ``start`` at pct=0 to ``end`` at pct=1 along half a cosine, as torch's
    OneCycleLR and CosineAnnealingLR anneal."""
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1.0)


def _lr(cfg: StepwiseLRConfig, t: float, total: float, base_lr: float, spans: _Spans) -> float:
    name = cfg.schedule
    if name == "constant":
        return base_lr
    if name == "step":
        return base_lr * cfg.gamma ** math.floor(t / spans.step_size + 1e-9)
    if name == "multistep":
        return base_lr * cfg.gamma ** bisect_right(spans.milestones, t + 1e-9)
    if name == "exponential":
        return base_lr * cfg.gamma ** (t / spans.step_size)
    if name == "onecycle":
        initial = base_lr / cfg.div_factor
        peak_at = cfg.pct_start * total
        if t < peak_at:
            return _cosine(initial, base_lr, t / peak_at)
        return _cosine(base_lr, initial / cfg.final_div_factor, min(1.0, (t - peak_at) / (total - peak_at)))
    # warmup_cosine / warmup_linear
    warmup = min(spans.warmup, total)
    if t < warmup:
        return base_lr * (cfg.warmup_start_factor + (1.0 - cfg.warmup_start_factor) * t / warmup)
    pct = min(1.0, (t - warmup) / (total - warmup)) if total > warmup else 1.0
    if name == "warmup_cosine":
        return _cosine(base_lr, cfg.min_lr, pct)
    return base_lr + (cfg.min_lr - base_lr) * pct


def _as_config(cfg: StepwiseLRConfig | dict[str, Any] | None) -> StepwiseLRConfig:
    if cfg is None:
        return StepwiseLRConfig()
    return cfg if isinstance(cfg, StepwiseLRConfig) else StepwiseLRConfig(**cfg)


def lr_at(
    cfg: StepwiseLRConfig | dict[str, Any] | None,
    t: float,
    total: float,
    base_lr: float,
    unit: str | None = None,
) -> float:
    """The learning rate at time ``t`` of a run that lasts ``total``.

    ``t`` and ``total`` are in the same unit, ``unit`` (``ep``, ``ba``, ``sp`` or
    ``s``). The config's durations must be written in ``dur`` (a fraction of
    ``total``) or in ``unit``; with ``unit=None`` only ``dur`` is accepted.
    ``base_lr`` is the optimizer's LR for one parameter group: the peak of the warm-up
    and one-cycle schedules and the start of the decaying ones. ``min_lr`` is absolute,
    as torch's ``eta_min``. ``exponential`` multiplies the LR by ``gamma`` once per
    ``step_size``, continuously: ``base_lr * gamma ** (t / step_size)``.

    >>> cfg = {"schedule": "warmup_cosine", "warmup": "0.1dur"}
    >>> round(lr_at(cfg, t=50, total=100, base_lr=0.1), 5)
    0.05868
    """
    cfg = _as_config(cfg)
    if total <= 0:
        raise ValueError(f"total must be > 0, got {total}")

    def convert(key: str, d: Duration) -> float:
        if d.unit == "dur":
            return d.value * total
        if d.unit == unit:
            return d.value
        wanted = f"'dur' or '{unit}'" if unit else "'dur' (or pass unit=...)"
        raise ValueError(f"{key}={d} cannot be compared with a time in {unit or 'no unit'}; write it in {wanted}")

    return _lr(cfg, t, total, base_lr, _spans(cfg, convert))


class StepwiseLR(Algorithm):
    """Learning-rate schedule applied every optimizer step (warm-up + cosine by default)."""

    name = "stepwise_lr"
    config_class = StepwiseLRConfig

    def __init__(self, config: StepwiseLRConfig | None = None) -> None:
        super().__init__(config)
        self.base_lrs: list[float] | None = None  # each param group's LR before scheduling
        self._epoch_t: float | None = None  # the clock at the current epoch's start
        self._spans: _Spans | None = None

    # The schedule's clock is the run's own unit (ep, ba, sp or s): `ba` means batches
    # of the loop, as max_duration does, whatever gradient accumulation does with them.
    def _now(self, state: State) -> float:
        unit = state.max_duration.unit
        if unit == "s":
            state.tick()  # elapsed_s is refreshed at batch_end; read the clock now
        return state.time_in(unit)

    def _convert(self, state: State) -> Callable[[str, Duration], float]:
        total = state.max_duration

        def convert(key: str, d: Duration) -> float:
            try:
                return state.fraction_of_run(d) * total.value
            except ValueError as exc:
                raise ConfigError(f"algorithms.{self.name}.{key}: {exc}") from None

        return convert

    def _apply(self, state: State, t: float) -> None:
        total = state.max_duration.value
        for group, base in zip(state.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = _lr(self.config, t, total, base, self._spans)

    @hookimpl
    def fit_start(self, state: State) -> None:
        groups = state.optimizer.param_groups
        if self.base_lrs is None:  # a fresh run; a resumed one restored them
            self.base_lrs = [float(g["lr"]) for g in groups]
        elif len(self.base_lrs) != len(groups):
            raise ConfigError(
                f"algorithms.{self.name}: the checkpoint has {len(self.base_lrs)} param groups, "
                f"the optimizer {len(groups)}"
            )
        if state.schedulers:
            warnings.warn(
                f"{self.name} sets the LR of every param group; the trainer's schedulers "
                "will fight it over the same LR",
                stacklevel=2,
            )
        self._spans = _spans(self.config, self._convert(state))
        if self.config.interval == "epoch" and self._epoch_t is None:
            self._epoch_t = self._now(state)
        self._apply(state, self._epoch_t if self.config.interval == "epoch" else self._now(state))

    @hookimpl
    def epoch_start(self, state: State) -> None:
        # A run resumed mid-epoch keeps the saved start-of-epoch time.
        if self.config.interval == "epoch" and state.timestamp.batch_in_epoch == 0:
            self._epoch_t = self._now(state)
            self._apply(state, self._epoch_t)

    @hookimpl
    def before_optimizer_step(self, state: State) -> None:
        # Set before the step, so the LR logged at batch_end is the one just used.
        if self.config.interval == "step":
            self._apply(state, self._now(state))

    def state_dict(self) -> dict[str, Any]:
        return {"base_lrs": list(self.base_lrs or []), "epoch_t": self._epoch_t}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base_lrs = [float(lr) for lr in state["base_lrs"]] or None
        self._epoch_t = state.get("epoch_t")


__all__ = ["INTERVALS", "SCHEDULES", "StepwiseLR", "StepwiseLRConfig", "lr_at"]
