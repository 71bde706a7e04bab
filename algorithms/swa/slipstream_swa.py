"""Stochastic weight averaging (SWA; Izmailov et al. 2018, with Composer's options):
an equal-weight average of the weights over the last part of the run, with batch-norm
statistics recomputed for it, replaces the trained weights at the end.

The run has three phases, read on the run's clock at each ``batch_end``:

1. before ``swa_start``: plain training;
2. the averaging window ``[swa_start, swa_end)``: every ``update_interval`` (from the
   window's first batch) the weights join the average, ``avg += (w - avg) / (n + 1)``
   (:func:`swa_update`); with ``swa_lr`` set, the plugin sets the LR from here to the
   end of the run, annealed from the LR in effect to ``swa_lr`` over ``anneal``
   (torch's ``SWALR`` in closed form, :func:`anneal_lr`);
3. from ``swa_end`` to the end of the run: the average is fixed and its batch-norm
   running statistics are recomputed as ``torch.optim.swa_utils.update_bn`` does (reset,
   ``momentum=None``: a cumulative mean over batches, train mode, no grad), by one extra
   forward of the averaged copy on each training batch as the model receives it
   (normalised, augmented, in its memory format: the loop's own input path).

When the run reaches its duration, the average (and its statistics) is copied into the
model, before the last checkpoint and the final evaluation. Doing the statistics pass
inside the loop, not after it over a loader of its own, gives it the engine's input
path for free and makes it part of the checkpoint (the running sums live in the
average's buffers), so a resume anywhere, in the pass too, is bit-exact.

Evaluation inside phases 2 and 3 uses the average, swapped in at ``eval_start`` and the
live weights back at ``eval_end``, as ``ema`` does (its batch-norm statistics are the
average of the live ones until phase 3 has seen a batch).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from slipstream import (
    Algorithm,
    ConfigError,
    Duration,
    State,
    check_plugin_options,
    check_value,
    hookimpl,
    parse_duration_option,
    plugin_option,
)

STRATEGIES = ("linear", "cos")
_TIMES = ("ba", "ep", "sp", "dur")  # no wall clock: the window must be comparable to the run


# -- the functional API ------------------------------------------------------------------


@torch.no_grad()
def swa_update(averaged: Sequence[Tensor], current: Sequence[Tensor], n_averaged: int) -> None:
    """Add ``current`` to the equal-weight average ``averaged`` of ``n_averaged`` earlier
    weights, in place: ``avg += (w - avg) / (n + 1)`` (a copy when ``n_averaged`` is 0).

    Floating-point tensors go through one fused ``torch._foreach_lerp_`` per device and
    dtype; the others (batch norm's ``num_batches_tracked``) are copied.

    >>> avg = [torch.tensor([0.0])]
    >>> for n, w in enumerate([0.0, 3.0, 6.0]):
    ...     swa_update(avg, [torch.tensor([w])], n)
    >>> avg[0].item()
    3.0
    """
    check_value("n_averaged", n_averaged, low=0, whole=True)
    pairs = list(zip(averaged, current, strict=True))
    floats = [(a, w) for a, w in pairs if a.is_floating_point() or a.is_complex()]
    others = [(a, w) for a, w in pairs if not (a.is_floating_point() or a.is_complex())]
    if floats:
        torch._foreach_lerp_([a for a, _ in floats], [w for _, w in floats], 1.0 / (n_averaged + 1))
    if others:
        torch._foreach_copy_([a for a, _ in others], [w for _, w in others])


def anneal_lr(start_lr: float, swa_lr: float, progress: float, strategy: str = "linear") -> float:
    """The LR ``progress`` (0 to 1, clamped) of the way from ``start_lr`` to ``swa_lr``:
    a straight line (``linear``) or half a cosine (``cos``), as torch's ``SWALR``.

    >>> anneal_lr(1.0, 0.0, 0.5), anneal_lr(1.0, 0.0, 0.25, "cos") > 0.75
    (0.5, True)
    """
    check_value("anneal_strategy", strategy, choices=STRATEGIES)
    t = min(1.0, max(0.0, progress))
    alpha = t if strategy == "linear" else (1.0 - math.cos(math.pi * t)) / 2.0
    return start_lr + (swa_lr - start_lr) * alpha


def batch_norms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The batch-norm layers of ``model`` that keep running statistics."""
    return [
        m for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats and m.running_mean is not None
    ]


def start_bn_pass(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """Reset the running statistics of ``model``'s batch norms and make them a plain
    mean over the batches that follow (``momentum=None``), as ``update_bn`` does first.
    Returns the layers (their momentum is left ``None``)."""
    layers = batch_norms(model)
    for layer in layers:
        layer.reset_running_stats()
        layer.momentum = None
    return layers


@torch.no_grad()
def update_bn(batches: Iterable[Any], model: nn.Module) -> int:
    """Recompute ``model``'s batch-norm running statistics from ``batches``
    (``torch.optim.swa_utils.update_bn``'s semantics: reset, cumulative mean, train
    mode, no grad; momentum and mode restored). A batch is the model's input or a
    tuple/list whose first item it is, already as the model takes it (on its device,
    normalised). Returns the number of batches used (0 and nothing done without batch norm).

    >>> m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    >>> update_bn([torch.ones(4, 2) * 3], m), m.training, m[1].momentum
    (1, True, 0.1)
    """
    layers = batch_norms(model)
    if not layers:
        return 0
    momenta = [layer.momentum for layer in layers]
    was_training = model.training
    start_bn_pass(model)
    model.train()
    count = 0
    try:
        for batch in batches:
            model(batch[0] if isinstance(batch, (tuple, list)) else batch)
            count += 1
    finally:
        for layer, momentum in zip(layers, momenta, strict=True):
            layer.momentum = momentum
        model.train(was_training)
    return count


# -- the config --------------------------------------------------------------------------


@dataclass
class SWAConfig:
    swa_start: str = "0.7dur"  # the averaging window opens (Composer's default)
    swa_end: str = "0.97dur"  # it closes; batch-norm statistics are recomputed after it
    update_interval: str = "1ep"  # between updates of the average, in ba or ep
    # null: the run's LR schedule goes on; a number: the LR the window anneals to
    swa_lr: Optional[float] = plugin_option(None, low=0)
    anneal: str = "0.1dur"  # how long the LR takes from its value at swa_start to swa_lr
    anneal_strategy: str = plugin_option("linear", choices=STRATEGIES)
    # null: every batch after swa_end; k: the first k of them only
    bn_batches: Optional[int] = plugin_option(None, low=1, whole=True)
    eval_with_swa: bool = True  # evaluations inside the window use the average

    def __post_init__(self) -> None:
        check_plugin_options(self)
        start = parse_duration_option(SWA.name, "swa_start", self.swa_start, units=_TIMES)
        end = parse_duration_option(SWA.name, "swa_end", self.swa_end, positive=True, units=_TIMES)
        parse_duration_option(SWA.name, "update_interval", self.update_interval, positive=True, units=("ba", "ep"))
        parse_duration_option(SWA.name, "anneal", self.anneal, units=_TIMES)
        if start.unit == "dur" and start.value >= 1:
            raise ValueError(f"swa_start must be below 1dur (the window must open), got {self.swa_start!r}")
        if start.unit == end.unit and start.value >= end.value:
            raise ValueError(f"swa_start must come before swa_end, got {self.swa_start!r} and {self.swa_end!r}")


def _distributed(state: State) -> bool:
    return state.world_size > 1 and dist.is_available() and dist.is_initialized()


@torch.no_grad()
def _all_mean(tensors: list[Tensor], world_size: int) -> None:
    """Each tensor replaced by its mean over the processes: one all_reduce per dtype."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    for group in groups.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        dist.all_reduce(flat)
        flat.div_(world_size)
        parts = flat.split([t.numel() for t in group])
        torch._foreach_copy_(group, [part.view_as(t) for part, t in zip(parts, group, strict=True)])


def _fraction(state: State, text: str) -> float | None:
    try:
        return state.fraction_of_run(text)
    except ValueError:
        return None  # ep in a run of unknown epoch length: compared on the clock only


# -- the plugin --------------------------------------------------------------------------


class SWA(Algorithm):
    """Stochastic weight averaging over the end of the run; the average, with
    recomputed batch-norm statistics, becomes the model at the end."""

    name = "swa"
    config_class = SWAConfig
    # Inside the window the checkpoint keeps the average as weights named `swa` (the
    # evaluations' weights): `slipstream eval --weights swa`, trainer.load_weights=swa.
    weights = "swa"
    # Copy the model after every plugin that changes its layers (the average's names
    # must be the model's); set the LR after stepwise_lr sets it (swa wins in its window).
    runs_after = (
        "locality_ffn", "blurpool", "stochastic_depth", "ghost_batchnorm", "sync_batchnorm", "channels_last",
        "activation_checkpointing", "stepwise_lr",
    )
    runs_before = ("torch_compile",)  # copy the plain module, not the compiled one
    conflicts_with = {
        "ema": (
            "both evaluate an average of the weights in place of the live ones and keep it as the "
            "checkpoint's weights, so which one a run's accuracy is of would be ambiguous; use one"
        ),
        "fsdp": (
            "averaging FSDP2's sharded (DTensor) parameters and the batch-norm pass of the copy are not "
            "verified; use DDP (the default) with swa"
        ),
    }

    def __init__(self, config: SWAConfig | None = None) -> None:
        super().__init__(config)
        cfg = self.config
        self.start = Duration.parse(cfg.swa_start)
        self.end = Duration.parse(cfg.swa_end)
        self.anneal = Duration.parse(cfg.anneal)
        self.averaged: nn.Module | None = None  # the average, a copy of the unwrapped model
        self.n_averaged = 0
        self.phase = "before"  # then "averaging", "bn" (the statistics pass) and "done"
        self.opened_at: int | None = None  # the batch count when the window opened
        self.anneal_t0: float | None = None  # the run's time then, in anneal's unit
        self.lr0: list[float] | None = None  # each group's LR at the window's first step
        self.bn_batches = 0  # batches seen by the statistics pass
        self._interval_batches = 1
        self._backup: list[Tensor] | None = None  # live tensors while the average is swapped in

    @property
    def swa_model(self) -> nn.Module:
        """The module holding the average (same names as the model)."""
        if self.averaged is None:
            raise RuntimeError("the average exists once the run's init event has fired")
        return self.averaged

    # -- set-up --------------------------------------------------------------------------

    @hookimpl
    def init(self, state: State) -> None:
        cfg = self.config
        start, end = _fraction(state, cfg.swa_start), _fraction(state, cfg.swa_end)
        if start is not None and start >= 1:
            raise ConfigError(
                f"algorithms.swa.swa_start: {cfg.swa_start} is not before the run's end "
                f"({state.max_duration}): the window would never open"
            )
        if end is not None and end > 1 + 1e-9:
            raise ConfigError(f"algorithms.swa.swa_end: {cfg.swa_end} is past the run's end ({state.max_duration})")
        if start is not None and end is not None and start >= end:
            raise ConfigError(
                f"algorithms.swa: swa_start={cfg.swa_start} must come before swa_end={cfg.swa_end} "
                f"in a run of {state.max_duration}"
            )
        interval = Duration.parse(cfg.update_interval)
        if interval.unit == "ep":
            if not state.batches_per_epoch:
                raise ConfigError(
                    f"algorithms.swa.update_interval: {cfg.update_interval} needs the batches per epoch, which "
                    "this training data does not tell; write it in ba"
                )
            self._interval_batches = max(1, round(interval.value * state.batches_per_epoch))
        else:
            if not float(interval.value).is_integer():
                raise ConfigError(f"algorithms.swa.update_interval: whole batches only, got {cfg.update_interval!r}")
            self._interval_batches = int(interval.value)
        model = state.unwrapped_model
        self.averaged = copy.deepcopy(model)
        self.averaged.requires_grad_(False)
        has_bn = bool(batch_norms(model))
        if state.rank == 0 and has_bn and end is not None and end >= 1:
            warnings.warn(
                f"slipstream: algorithms.swa.swa_end={cfg.swa_end} leaves no batch to recompute the average's "
                "batch-norm statistics: they will be the average of the live ones (set swa_end below 1dur)",
                stacklevel=2,
            )

    @hookimpl
    def fit_start(self, state: State) -> None:
        if self.config.swa_lr is not None and state.schedulers and state.rank == 0:
            warnings.warn(
                "slipstream: algorithms.swa sets the LR of every param group from swa_start on; the trainer's "
                "schedulers will fight it over the same LR",
                stacklevel=2,
            )

    # -- the clock -----------------------------------------------------------------------

    @hookimpl
    def batch_end(self, state: State) -> None:
        if self.phase == "done":
            return
        ts = state.timestamp
        past_end = state.time_in(self.end.unit) >= self.end.value
        if self.phase == "before" and state.time_in(self.start.unit) >= self.start.value:
            self.phase = "averaging"
            self.opened_at = ts.batch
            self.anneal_t0 = state.time_in(self.anneal.unit)
        if self.phase == "averaging":
            if past_end:
                self.phase = "bn"  # the average is final; its statistics come next
            elif (ts.batch - self.opened_at) % self._interval_batches == 0:
                self._update(state)
        total = state.max_duration
        if state.time_in(total.unit) >= total.value and state.stop_status != "diverged":
            self._finish(state)

    def _live(self, state: State) -> list[Tensor]:
        return list(state.unwrapped_model.state_dict().values())

    def _mine(self) -> list[Tensor]:
        return list(self.swa_model.state_dict().values())

    def _update(self, state: State) -> None:
        swa_update(self._mine(), self._live(state), self.n_averaged)
        self.n_averaged += 1
        # Under DDP each rank's batch-norm statistics are its own batches' (DDP only
        # broadcasts rank 0's before each forward); the checkpoint keeps rank 0's average,
        # so every rank must hold the same one for a resume to be exact: their mean.
        if _distributed(state):
            _all_mean([b for b in self.swa_model.buffers() if b.is_floating_point()], state.world_size)

    # -- the LR --------------------------------------------------------------------------

    @hookimpl
    def before_optimizer_step(self, state: State) -> None:
        swa_lr = self.config.swa_lr
        if swa_lr is None or self.phase not in ("averaging", "bn"):
            return
        groups = state.optimizer.param_groups
        if self.lr0 is None:  # the window's first step: the LR stepwise_lr (or the run) just set
            self.lr0 = [float(g["lr"]) for g in groups]
        if self.anneal.value <= 0:
            progress = 1.0
        else:
            progress = (state.time_in(self.anneal.unit) - self.anneal_t0) / self.anneal.value
        top = max(self.lr0, default=0.0)
        for group, lr0 in zip(groups, self.lr0, strict=True):
            # Groups keep their ratio to the highest one (backbone_lr_scale, layer_decay).
            target = swa_lr * lr0 / top if top > 0 else swa_lr
            group["lr"] = anneal_lr(lr0, target, progress, self.config.anneal_strategy)

    # -- the batch-norm pass -------------------------------------------------------------

    @hookimpl(wrapper=True, trylast=True)
    def forward(self, state: State) -> Iterator[None]:
        # Innermost: under the autocast in effect, on the batch exactly as the model gets it.
        cap = self.config.bn_batches
        if state.training and self.phase == "bn" and self.n_averaged and (cap is None or self.bn_batches < cap):
            self._bn_step(state)
        return (yield)

    @torch.no_grad()
    def _bn_step(self, state: State) -> None:
        model = self.swa_model
        if self.bn_batches == 0:
            if not start_bn_pass(model):
                self.bn_batches = -1  # no batch norm: nothing to recompute, never again
                return
        elif self.bn_batches < 0:
            return
        model.train()
        model(state.batch[0])
        self.bn_batches += 1
        if _distributed(state):  # the statistics of every rank's batch, the same on each rank
            _all_mean([t for layer in batch_norms(model) for t in (layer.running_mean, layer.running_var)],
                      state.world_size)

    # -- the end -------------------------------------------------------------------------

    def _finish(self, state: State) -> None:
        self.phase = "done"
        if not self.n_averaged:
            state.summary["swa_models"] = 0
            return
        self._restore(state)
        with torch.no_grad():
            torch._foreach_copy_(self._live(state), self._mine())
        state.summary.update(
            swa=True, swa_models=self.n_averaged, swa_bn_batches=max(self.bn_batches, 0), swa_replaced=True
        )

    # -- evaluation with the average ------------------------------------------------------

    @hookimpl
    def eval_start(self, state: State) -> None:
        if not self.config.eval_with_swa or self._backup is not None:
            return
        if self.phase not in ("averaging", "bn") or not self.n_averaged:
            return
        live = self._live(state)
        self._backup = [t.detach().clone() for t in live]
        with torch.no_grad():
            torch._foreach_copy_(live, self._mine())
        state.summary["swa"] = True

    @hookimpl
    def eval_end(self, state: State) -> None:
        self._restore(state)

    @hookimpl
    def exception(self, state: State, error: BaseException) -> None:
        self._restore(state)  # a failed evaluation must not leave the average in the model

    @hookimpl
    def fit_end(self, state: State) -> None:
        self._restore(state)
        state.summary.setdefault("swa_models", self.n_averaged)
        state.summary.setdefault("swa_replaced", False)

    def _restore(self, state: State) -> None:
        if self._backup is None:
            return
        with torch.no_grad():
            torch._foreach_copy_(self._live(state), self._backup)
        self._backup = None

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        if self.averaged is None:
            return {}
        out: dict[str, Any] = {
            "n_averaged": self.n_averaged,
            "phase": self.phase,
            "opened_at": self.opened_at,
            "anneal_t0": self.anneal_t0,
            "lr0": self.lr0,
            "bn_batches": self.bn_batches,
        }
        # Once done, the model's own weights are the average: no second copy to choose.
        if self.phase != "done" and self.n_averaged:
            out["weights"] = self.swa_model.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Called after init (the hook contract): the copy exists.
        if not state:
            return
        if "weights" in state:
            self.swa_model.load_state_dict(state["weights"])
        self.n_averaged = int(state["n_averaged"])
        self.phase = str(state["phase"])
        self.opened_at = state["opened_at"]
        self.anneal_t0 = state["anneal_t0"]
        self.lr0 = state["lr0"]
        self.bn_batches = int(state["bn_batches"])
        if self.phase == "bn" and self.bn_batches > 0:
            for layer in batch_norms(self.swa_model):  # the pass goes on as a plain mean
                layer.momentum = None


__all__ = [
    "SWA", "SWAConfig", "anneal_lr", "batch_norms", "start_bn_pass", "swa_update", "update_bn",
]
