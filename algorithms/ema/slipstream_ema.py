"""Exponential moving average (EMA) of the weights, evaluated in place of the live weights.

The average is kept by ``torch.optim.swa_utils.AveragedModel`` (a copy of the
unwrapped model, made at ``init``) and updated after each optimizer step with
:func:`ema_update`, one fused ``torch._foreach_lerp_`` per device and dtype. At
evaluation the averaged weights are copied into the model the engine evaluates,
and the live weights are copied back afterwards (also when the run fails), so the
evaluator, the metrics and every other plugin see the EMA without knowing of it.

Time, not step count, sets the decay: each update applies ``decay ** k`` for the
``k`` optimizer steps since the previous one (``update_every``, skipped steps), or
``0.5 ** (b / half_life)`` for the ``b`` batches since then when ``half_life`` is a
duration — so under gradient accumulation of ``n`` batches the per-step decay is
``0.5 ** (n / half_life_in_batches)``, i.e. the half-life counted in optimizer steps.

A sharded model (FSDP, parameters that are DTensors) gets a sharded average: each
process averages its own shards only (:class:`LocalShards`), so the EMA costs 1/N of
the model per process, as the model does; checkpoints gather it to full weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.swa_utils import AveragedModel

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

DEFAULT_DECAY = 0.999


@torch.no_grad()
def ema_update(ema_params: Sequence[Tensor], params: Sequence[Tensor], decay: float) -> None:
    """In place, ``ema = decay * ema + (1 - decay) * param`` for each pair of tensors.

    Floating-point tensors are interpolated with ``torch._foreach_lerp_`` (a fused
    kernel per device and dtype); other tensors (BatchNorm's integer
    ``num_batches_tracked``) cannot be averaged and are copied.
    """
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay must be in [0, 1], got {decay}")
    pairs = list(zip(ema_params, params, strict=True))
    floats = [(e, p) for e, p in pairs if e.is_floating_point() or e.is_complex()]
    others = [(e, p) for e, p in pairs if not (e.is_floating_point() or e.is_complex())]
    if floats:
        torch._foreach_lerp_([e for e, _ in floats], [p for _, p in floats], 1.0 - decay)
    if others:
        torch._foreach_copy_([e for e, _ in others], [p for _, p in others])


def half_life_decay(half_life: float, elapsed: float = 1.0) -> float:
    """The decay over ``elapsed`` units of time for an average that forgets half of
    the past every ``half_life`` units: ``0.5 ** (elapsed / half_life)``."""
    if half_life <= 0:
        raise ValueError(f"half_life must be > 0, got {half_life}")
    return 0.5 ** (elapsed / half_life)


@dataclass
class EMAConfig:
    # per optimizer step; 0.999 when neither decay nor half_life is set
    decay: Optional[float] = plugin_option(None, low=0, high=1, low_open=True, high_open=True, note="e.g. 0.999")
    half_life: Optional[str] = None  # a duration: "50ba", "0.1ep", "0.01dur", "5000sp"
    # optimizer steps between updates (the decay covers them all)
    update_every: int = plugin_option(1, low=1, whole=True)
    start: Optional[str] = None  # before this time the EMA is a plain copy of the weights
    eval_with_ema: bool = True  # evaluate with the averaged weights
    average_buffers: bool = True  # average BatchNorm statistics too (False: copy them)

    def __post_init__(self) -> None:
        check_plugin_options(self)
        if self.decay is not None and self.half_life is not None:
            raise ValueError(
                f"set only one of decay and half_life, got decay={self.decay} and "
                f"half_life={self.half_life!r}"
            )
        if self.half_life is not None:  # e.g. '50ba', '0.1ep', '0.01dur'
            parse_duration_option(EMA.name, "half_life", self.half_life, positive=True, units=("ba", "ep", "sp", "dur"))
        if self.start is not None:
            parse_duration_option(EMA.name, "start", self.start)


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class LocalShards(nn.Module):
    """This process's shards of a sharded model's parameters (then its buffers), as
    parameters and buffers of a flat module that shares their storage, in the model's
    order: what ``AveragedModel`` averages when the model is sharded.

    ``full_state_dict``/``load_full_state_dict`` convert the shards of a module of this
    layout (the average) to and from full tensors under the model's own names.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        named = list(model.named_parameters())
        self.names = [n for n, _ in named] + [n for n, _ in model.named_buffers()]
        # (mesh, placements, shape, stride) of each sharded tensor; None for plain ones.
        self.specs = [
            (p.device_mesh, p.placements, p.shape, p.stride()) if isinstance(p, DTensor) else None
            for _, p in named
        ]
        self.shards = nn.ParameterList(
            [nn.Parameter(_local(p.detach()), requires_grad=False) for _, p in named]
        )
        for i, (_, b) in enumerate(model.named_buffers()):
            self.register_buffer(f"buffer{i}", _local(b))
            self.specs.append(None)

    def _tensors(self, module: nn.Module) -> list[Tensor]:
        return [*module.parameters(), *module.buffers()]

    def full_state_dict(self, module: nn.Module) -> dict[str, Tensor]:
        """Full tensors of ``module``'s shards (a collective: call on every rank)."""
        out = {}
        for name, spec, t in zip(self.names, self.specs, self._tensors(module), strict=True):
            if spec is not None:
                mesh, placements, shape, stride = spec
                t = DTensor.from_local(t, mesh, placements, shape=shape, stride=stride).full_tensor()
            out[name] = t.detach().cpu()
        return out

    @torch.no_grad()
    def load_full_state_dict(self, module: nn.Module, state_dict: dict[str, Tensor]) -> None:
        """Keep this process's shards of the full tensors in ``state_dict``."""
        for name, spec, t in zip(self.names, self.specs, self._tensors(module), strict=True):
            full = state_dict[name].to(t.device)
            if spec is not None:
                full = distribute_tensor(full, spec[0], spec[1], src_data_rank=None).to_local()
            t.copy_(full)


def _half_life_in_batches(state: State, text: str) -> float:
    half_life = Duration.parse(text)
    if half_life.unit == "ba":
        return half_life.value
    try:  # fraction_of_run("1ba") is 1 / (batches in the run)
        return state.fraction_of_run(half_life) / state.fraction_of_run(Duration(1.0, "ba"))
    except ValueError as exc:
        raise ConfigError(
            f"algorithms.ema.half_life: cannot convert {text!r} to batches in this run ({exc}); "
            "write it in ba"
        ) from None


class EMA(Algorithm):
    """Exponential moving average of the weights; evaluation uses the averaged weights."""

    name = "ema"
    config_class = EMAConfig
    # The average is kept under state_dict()["weights"] with the model's names, so that
    # `slipstream eval --ema`, export and fine-tuning (trainer.load_weights=ema) use it.
    weights = "ema"
    # Average the final parameters (the shards, once fsdp has sharded them).
    runs_after = ("locality_ffn", "channels_last", "fsdp")
    runs_before = ("torch_compile",)  # copy the plain module, not the compiled one

    def __init__(self, config: EMAConfig | None = None) -> None:
        super().__init__(config)
        cfg = self.config
        # Decay per optimizer step, or a half-life in batches (converted at init).
        self.decay: float | None = None
        if cfg.half_life is None:
            self.decay = cfg.decay if cfg.decay is not None else DEFAULT_DECAY
        self.half_life_batches: float | None = None
        self.last_decay: float | None = None  # the decay applied by the latest update
        self.averaged: AveragedModel | None = None
        self._start = Duration.parse(cfg.start) if cfg.start else None
        self._last_step = 0  # optimizer steps at the latest update
        self._last_batch = 0  # batches at the latest update
        self._backup: list[Tensor] | None = None  # live weights while the EMA is swapped in
        self._shards: LocalShards | None = None  # the live model's shards, when it is sharded

    @property
    def ema_model(self) -> nn.Module:
        """The module holding the averaged weights (same keys as the model)."""
        if self.averaged is None:
            raise RuntimeError("the EMA exists once the run's init event has fired")
        return self.averaged.module

    def _average(self, ema: list[Tensor], live: list[Tensor], n_averaged: Any) -> None:
        ema_update(ema, live, self.last_decay)

    def _live(self, state: State) -> nn.Module:
        """The weights the average follows: the model, or its local shards."""
        return self._shards if self._shards is not None else state.unwrapped_model

    @hookimpl
    def init(self, state: State) -> None:
        if self.config.half_life is not None:
            self.half_life_batches = _half_life_in_batches(state, self.config.half_life)
        model = state.unwrapped_model
        if any(isinstance(p, DTensor) for p in model.parameters()):  # sharded (FSDP)
            self._shards = LocalShards(model)
            state.summary["ema_sharded"] = True
        self.averaged = AveragedModel(
            self._live(state),
            multi_avg_fn=self._average,
            use_buffers=self.config.average_buffers,
        )
        self.averaged.requires_grad_(False)

    @hookimpl
    def fit_start(self, state: State) -> None:
        if int(self.averaged.n_averaged) == 0:  # nothing averaged yet, or resumed without EMA
            self._copy_into(_tensors(self.ema_model, True), _tensors(self._live(state), True))

    @hookimpl
    def after_optimizer_step(self, state: State) -> None:
        if state.step_skipped:  # weights unchanged; the next update covers this step's time
            return
        ts = state.timestamp
        batches = ts.batch + 1  # this batch is counted only after the step
        start = self._start
        if start is not None and state.time_in(start.unit) < start.value:
            self.averaged.n_averaged.zero_()  # AveragedModel copies when nothing is averaged
        elif ts.optimizer_steps - self._last_step < self.config.update_every:
            return
        if int(self.averaged.n_averaged) == 0:  # a CPU counter: no device sync
            self.last_decay = 0.0  # a copy
        elif self.half_life_batches is not None:
            self.last_decay = half_life_decay(self.half_life_batches, batches - self._last_batch)
        else:
            self.last_decay = self.decay ** (ts.optimizer_steps - self._last_step)
        self.averaged.update_parameters(self._live(state))
        self._last_step, self._last_batch = ts.optimizer_steps, batches

    # -- evaluation with the averaged weights ----------------------------------------

    @hookimpl
    def eval_start(self, state: State) -> None:
        if not self.config.eval_with_ema or self._backup is not None:
            return
        buffers = self.config.average_buffers  # copied buffers: the live ones are fresher
        live = _tensors(self._live(state), buffers)
        self._backup = [t.detach().clone() for t in live]
        self._copy_into(live, _tensors(self.ema_model, buffers))
        state.summary["ema"] = True
        if self.half_life_batches is not None:
            state.summary["ema_half_life_batches"] = self.half_life_batches
        else:
            state.summary["ema_decay"] = self.decay

    @hookimpl
    def eval_end(self, state: State) -> None:
        self._restore(state)

    @hookimpl
    def exception(self, state: State, error: BaseException) -> None:
        self._restore(state)  # a failed evaluation must not leave the EMA in the model

    @hookimpl
    def fit_end(self, state: State) -> None:
        self._restore(state)

    def _restore(self, state: State) -> None:
        if self._backup is None:
            return
        self._copy_into(_tensors(self._live(state), self.config.average_buffers), self._backup)
        self._backup = None

    @staticmethod
    @torch.no_grad()
    def _copy_into(dst: list[Tensor], src: list[Tensor]) -> None:
        torch._foreach_copy_(dst, src)

    # -- checkpoints -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        if self.averaged is None:
            return {}
        return {
            # Full weights under the model's names, also when each rank holds shards.
            "weights": (
                self._shards.full_state_dict(self.ema_model)
                if self._shards is not None
                else self.ema_model.state_dict()
            ),
            "n_averaged": int(self.averaged.n_averaged),
            "last_step": self._last_step,
            "last_batch": self._last_batch,
            "last_decay": self.last_decay,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The engine calls this after init (the hook contract), so the copy exists.
        if not state:
            return
        if self._shards is not None:
            self._shards.load_full_state_dict(self.ema_model, state["weights"])
        else:
            self.ema_model.load_state_dict(state["weights"])
        self.averaged.n_averaged.fill_(int(state["n_averaged"]))
        self._last_step = int(state["last_step"])
        self._last_batch = int(state["last_batch"])
        self.last_decay = state.get("last_decay")


def _tensors(model: nn.Module, with_buffers: bool) -> list[Tensor]:
    """Parameters (and buffers), detached, in AveragedModel's order."""
    tensors = [p.detach() for p in model.parameters()]
    return tensors + [b.detach() for b in model.buffers()] if with_buffers else tensors
