"""Mixed precision: run the forward pass and the loss under ``torch.autocast``.

Matmuls and convolutions run in bf16 (or fp16) while weights, gradients and the
optimizer stay fp32, so each step moves half the bytes through the big kernels and
uses the low-precision units of the hardware (AVX-512 BF16 / AMX on CPU, tensor
cores on CUDA). fp16 has a narrow exponent range, so it also needs loss scaling: a
``torch.amp.GradScaler`` multiplies the loss before backward, unscales the gradients
before anything reads them, and skips the optimizer step when they overflowed.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slipstream import DTYPES as ALL_DTYPES
from slipstream import (
    NOT_MINE,
    Algorithm,
    ConfigError,
    State,
    Variant,
    check_plugin_options,
    check_value,
    cpu_kind,
    hookimpl,
    native_bf16,
    plugin_option,
)

DTYPES = {name: ALL_DTYPES[name] for name in ("bf16", "fp16")}  # the reduced precisions
CHOICES = ("auto", *DTYPES)
# dtype auto: a reduced precision changes the numerics, so it must win clearly.
REDUCED_MARGIN = 0.10


@dataclass
class MixedPrecisionConfig:
    # "auto": the reduced precision the device computes natively: on CUDA bf16 where
    # torch.cuda.is_bf16_supported(), fp16 with loss scaling otherwise; on a CPU bf16
    # where it has bf16 units (AVX-512 BF16 / AMX), full precision (no autocast) where
    # it has none, because emulated bf16 is far slower than fp32 there. Where the device
    # has a reduced precision, the engine times a few training steps of the run's own
    # model in it and in fp32 at fit start and keeps it only where it is more than
    # REDUCED_MARGIN faster (trainer.autotune, docs/auto.md).
    dtype: str = plugin_option("auto", choices=CHOICES)
    # fp16: warn (and say so in summary.json) when the GradScaler skips this many
    # optimizer steps in a row. A healthy run skips a few at the start while the
    # scale comes down from 2**16; this many in a row means it is not training.
    warn_after_skips: int = plugin_option(25, low=1, whole=True, note="optimizer steps")

    def __post_init__(self) -> None:
        check_plugin_options(self)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 convolutions and matmuls in hardware (AVX-512 BF16
    or AMX): :func:`slipstream.native_bf16`, the engine's one detector, which honours
    ``SLIPSTREAM_CPU_KIND``. Without it PyTorch falls back to generic bf16 kernels: a
    CIFAR-stem ResNet-18 step ran 12x slower in bf16 than in fp32 on an AVX2-only AMD EPYC."""
    return native_bf16()


def resolve_dtype(dtype: str, device: torch.device | str) -> torch.dtype:
    """The compute dtype that ``dtype`` ("auto", "bf16" or "fp16") means on ``device``.

    ``torch.float32`` means no autocast: what ``auto`` gives on a CPU without bf16
    units.

    >>> resolve_dtype("bf16", "cpu")
    torch.bfloat16
    >>> resolve_dtype("auto", "cpu") == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    True
    """
    device = torch.device(device)
    check_value("dtype", dtype, choices=CHOICES)
    bf16_ok = device.type != "cuda" or torch.cuda.is_bf16_supported()
    if dtype == "auto":
        if device.type == "cpu":
            return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        return torch.bfloat16 if bf16_ok else torch.float16
    if dtype == "bf16" and not bf16_ok:
        raise ValueError(
            f"dtype bf16 is not supported on {device} ({torch.cuda.get_device_name(device)}); "
            "use dtype fp16 or auto"
        )
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return next((name for name, d in DTYPES.items() if d == dtype), "fp32")


def autocast(device: torch.device | str, dtype: torch.dtype) -> torch.autocast:
    """The autocast context the plugin puts around ``forward`` and ``compute_loss``
    (use it the same way in a loop of your own)."""
    return torch.autocast(torch.device(device).type, dtype=dtype)


# -- the oneDNN bf16 fault on 1x1 maps ----------------------------------------------------


def _on_a_1x1_map(args: tuple[Any, ...]) -> bool:
    x = args[0] if args else None
    return isinstance(x, torch.Tensor) and x.dim() == 4 and (x.shape[-2] == 1 or x.shape[-1] == 1)


def _fp32_before(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    if not (_on_a_1x1_map(args) and torch.is_autocast_enabled("cpu")):
        return None
    context = torch.autocast("cpu", enabled=False)
    context.__enter__()
    module._slipstream_fp32 = context  # left by the forward hook below
    return (args[0].float(), *args[1:])


def _fp32_after(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    context = module.__dict__.pop("_slipstream_fp32", None)
    if context is not None:
        context.__exit__(None, None, None)


def keep_1x1_convs_in_fp32(model: nn.Module) -> list[Any]:
    """Run in fp32, outside CPU autocast, every strided convolution with a kernel larger
    than 1x1 when its input map is one pixel high or wide; returns the hook handles.

    oneDNN's bf16 kernels return a non-finite weight gradient for such a convolution in
    about one call of two (3x3 stride 2 on a 1x1 map, channels-last or not; torch
    2.14.1 on AMX and on AVX-512 BF16 CPUs): an ImageNet-stem ResNet's last stage at 16
    to 32 px. The same convolution on a 2x2 map, or with stride 1, is sound. A 1x1 map
    is a few FLOPs, so fp32 costs nothing measurable there."""
    handles = []
    for module in model.modules():
        if isinstance(module, nn.Conv2d) and max(module.stride) > 1 and max(module.kernel_size) > 1:
            handles.append(module.register_forward_pre_hook(_fp32_before))
            handles.append(module.register_forward_hook(_fp32_after))
    return handles


class MixedPrecision(Algorithm):
    """Autocast forward and loss to bf16/fp16 (fp16 with a GradScaler)."""

    name = "mixed_precision"
    config_class = MixedPrecisionConfig
    runs_before = ("grad_clipping",)

    def __init__(self, config: MixedPrecisionConfig | None = None) -> None:
        super().__init__(config)
        self.dtype: torch.dtype | None = None
        self.device_type = "cpu"
        self.scaler: torch.amp.GradScaler | None = None
        self.skipped_steps = 0
        self.skip_streak = 0  # optimizer steps skipped in a row, up to now
        self.longest_skip_streak = 0
        self._warned = False
        self._stepped = False
        self._watched: torch.optim.Optimizer | None = None
        self._watch_handle: Any = None
        self._guards: list[Any] = []  # keep_1x1_convs_in_fp32's hooks

    @property
    def active(self) -> bool:
        """Whether forward and loss run under autocast (not when auto chose fp32)."""
        return self.dtype is not None and self.dtype != torch.float32

    # -- set-up ----------------------------------------------------------------------

    def variants(self, state: State) -> list[Variant]:
        """dtype auto on a device with a native reduced precision: that precision
        (the fallback, taken only where more than 10 % faster) or fp32. Nothing to
        choose for an explicit dtype, nor on a CPU without bf16 units (emulated bf16
        is many times slower: fp32 without measuring)."""
        if self.config.dtype != "auto":
            return []
        try:
            reduced = resolve_dtype("auto", state.device)
        except ValueError:
            return []
        if reduced == torch.float32:
            return []
        return [Variant(dtype_name(reduced), margin=REDUCED_MARGIN), Variant("fp32")]

    @hookimpl
    def init(self, state: State) -> None:
        measured = self.config.dtype == "auto" and self.variant is not None
        try:
            if measured:
                self.dtype = DTYPES.get(self.variant, torch.float32)
            else:
                self.dtype = resolve_dtype(self.config.dtype, state.device)
        except ValueError as exc:
            raise ConfigError(f"algorithms.mixed_precision: {exc}") from None
        self.device_type = state.device.type
        state.summary["autocast_dtype"] = dtype_name(self.dtype)
        if self.dtype == torch.float32 and measured:
            return  # fp32 was faster on this model here: the engine's auto line says so
        if self.dtype == torch.float32:
            # auto on a CPU without bf16 units: the fastest precision here is fp32.
            warnings.warn(
                f"mixed_precision: this CPU ({cpu_kind()}) has no bf16 units (AVX-512 BF16 or AMX), where "
                "bf16 is emulated and several times slower than fp32; training in full "
                "precision (set dtype: bf16 to force it)",
                stacklevel=2,
            )
            return
        state.compute_dtype = self.dtype
        if self.dtype == torch.bfloat16 and self.device_type == "cpu":
            self._guards = keep_1x1_convs_in_fp32(state.unwrapped_model)
        if self.dtype == torch.bfloat16 and self.device_type == "cpu" and not cpu_has_native_bf16():
            warnings.warn(
                f"mixed_precision: dtype bf16 on a CPU without bf16 units ({cpu_kind()}; AVX-512 BF16 "
                "or AMX have them) is emulated and usually far slower than fp32; dtype auto picks fp32 here",
                stacklevel=2,
            )
        if self.dtype == torch.float16:
            if self.device_type == "cpu":
                # It works (GradScaler("cpu") is tested), but CPUs without native fp16
                # emulate it: ResNet-18 ran about 25x slower than fp32 on this project's
                # AVX-512 machine, against 1.7x faster in bf16.
                warnings.warn(
                    "mixed_precision: fp16 on CPU is usually far slower than fp32; "
                    "use dtype bf16 (or auto) on CPU",
                    stacklevel=2,
                )
            self.scaler = torch.amp.GradScaler(self.device_type)

    # -- autocast around the engine's own steps -----------------------------------------

    @hookimpl(wrapper=True)
    def forward(self, state: State) -> Iterator[None]:
        # Also called at evaluation, which gets the same speed-up.
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.active):
            return (yield)

    @hookimpl(wrapper=True)
    def compute_loss(self, state: State) -> Iterator[None]:
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.active):
            loss = yield
        # Backward and the loss scaler want an fp32 loss whatever the loss function did.
        return loss.float()

    # -- fp16 only: loss scaling -------------------------------------------------------
    # These replace the engine's steps; with bf16 they return NOT_MINE so the engine's
    # defaults run.

    @hookimpl
    def backward(self, state: State) -> Any:
        if self.scaler is None:
            return NOT_MINE
        self.scaler.scale(state.loss).backward()
        return True

    @hookimpl(tryfirst=True)
    def before_optimizer_step(self, state: State) -> None:
        # First of all before_optimizer_step hooks, so that clipping and every
        # other reader of .grad sees true gradients.
        if self.scaler is not None:
            self.scaler.unscale_(state.optimizer)

    @hookimpl
    def optimizer_step(self, state: State) -> Any:
        if self.scaler is None:
            return NOT_MINE
        optimizer, scaler = state.optimizer, self.scaler
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # Fused optimizers skip on the device, so only the scale tells, at the
            # cost of one device sync per step.
            before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            skipped = scaler.get_scale() < before
        else:
            # GradScaler.step already reads its inf flag on the host and calls
            # optimizer.step() only for finite gradients; a step hook sees whether
            # it did, with no device sync of our own.
            self._watch(optimizer)
            self._stepped = False
            scaler.step(optimizer)
            scaler.update()
            skipped = not self._stepped
        if skipped:
            self.skipped_steps += 1
            self.skip_streak += 1
            self.longest_skip_streak = max(self.longest_skip_streak, self.skip_streak)
            if self.skip_streak >= self.config.warn_after_skips and not self._warned:
                self._warn_streak(state)
        else:
            self.skip_streak = 0
        state.metrics["skipped_steps"] = self.skipped_steps
        return not skipped

    def _warn_streak(self, state: State) -> None:
        self._warned = True
        last = state.timestamp.optimizer_steps + 1
        message = (
            f"mixed_precision: the fp16 GradScaler skipped {self.skip_streak} optimizer steps "
            f"in a row (steps {last - self.skip_streak + 1}-{last}, loss scale now "
            f"{self.scaler.get_scale():g}): the gradients overflow at every scale, so the "
            "weights are not being updated; use dtype bf16, a lower optimizer.lr or grad_clipping"
        )
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        state.summary.setdefault("warnings", []).append(message)

    def _watch(self, optimizer: torch.optim.Optimizer) -> None:
        if self._watched is optimizer:
            return
        if self._watch_handle is not None:
            self._watch_handle.remove()

        def stepped(*_: Any) -> None:
            self._stepped = True

        self._watch_handle = optimizer.register_step_post_hook(stepped)
        self._watched = optimizer

    def export_model(self, model: nn.Module) -> nn.Module:
        # An exported model runs in fp32 (no autocast): the fp32 guards have nothing to do.
        for handle in self._guards:
            handle.remove()
        self._guards = []
        return model

    @hookimpl
    def fit_end(self, state: State) -> None:
        self._record(state)
        if self.scaler is not None:
            state.summary["loss_scale"] = self.scaler.get_scale()

    @hookimpl
    def exception(self, state: State) -> None:
        # No device access here: it could fail too and hide the run's real error.
        self._record(state)

    def _record(self, state: State) -> None:
        if self._watch_handle is not None:
            self._watch_handle.remove()
            self._watch_handle = self._watched = None
        if self.scaler is not None:
            state.summary["skipped_steps"] = self.skipped_steps
            state.summary["longest_skip_streak"] = self.longest_skip_streak

    # -- persistence ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "dtype": dtype_name(self.dtype) if self.dtype is not None else self.config.dtype,
            "skipped_steps": self.skipped_steps,
        }
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()  # floats and ints only
            out["skip_streak"] = self.skip_streak
            out["longest_skip_streak"] = self.longest_skip_streak
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.skip_streak = int(state.get("skip_streak", 0))
        self.longest_skip_streak = int(state.get("longest_skip_streak", 0))
        saved = state.get("scaler")
        # Called after init (the hook contract), so an fp16 run has its scaler; a
        # bf16 run resumed from an fp16 checkpoint has none to restore.
        if saved is not None and self.scaler is not None:
            self.scaler.load_state_dict(saved)
