"""Sharpness-aware minimisation (SAM; Foret et al. 2021, as in Composer): step with the
gradient taken at the worst nearby weights instead of at the weights themselves.

Each SAM step takes the batch's gradient ``g`` at the weights ``w`` (the run's own
backward), moves the weights to ``w + e`` with ``e = rho * g / (||g|| + epsilon)``
(``||g||`` the L2 norm over every parameter the optimizer holds; Composer's formula),
computes the loss and its gradient again at ``w + e``, puts ``w`` back (copied, so
exactly) and lets the optimizer step with that second gradient. It costs a second
forward and backward pass; ``interval`` k applies it on every k-th optimizer step only
(plain steps in between), as Composer does.

The second pass happens inside the ``backward`` step, so everything after it (the
GradScaler's unscale, clipping, the optimizer step, EMA) sees the second gradient as
"the" gradient. It calls ``state.model`` and the loss function in effect at
``compute_loss`` under the autocast in effect at ``forward`` (captured by innermost
wrappers), so ``mixed_precision`` (bf16) and ``label_smoothing`` apply to it too.
Buffers (batch-norm running statistics) are kept as the first pass left them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from slipstream import Algorithm, ConfigError, State, check_plugin_options, check_value, hookimpl, plugin_option


@dataclass
class SamConfig:
    # radius of the perturbation: the weights move this far (L2) along the gradient
    rho: float = plugin_option(0.05, low=0, low_open=True, note="Composer's and the paper's default: 0.05")
    # added to the gradient norm before dividing by it
    epsilon: float = plugin_option(1e-12, low=0)
    # SAM on every k-th optimizer step (steps k-1, 2k-1, ...), plain steps in between
    interval: int = plugin_option(1, low=1, whole=True, note="optimizer steps")

    def __post_init__(self) -> None:
        check_plugin_options(self)


def _check(rho: float, epsilon: float) -> None:
    check_value("rho", rho, low=0, low_open=True)
    check_value("epsilon", epsilon, low=0)


def sam_applies(step: int, interval: int) -> bool:
    """Whether optimizer step ``step`` (0-based) is a SAM step: every ``interval``-th,
    the first of them being step ``interval - 1`` (Composer's ``(step + 1) % interval``).

    >>> [sam_applies(s, 2) for s in range(4)]
    [False, True, False, True]
    """
    return (step + 1) % interval == 0


@torch.no_grad()
def perturb(params: Iterable[Tensor], rho: float = 0.05, epsilon: float = 1e-12) -> tuple[list[Tensor], list[Tensor]]:
    """Move each parameter that has a gradient by ``rho * grad / (||g|| + epsilon)``,
    ``||g||`` the total L2 norm of all those gradients (a device tensor: no sync).

    Returns ``(params, saved)``: the parameters moved and their weights before, for
    :func:`restore`. Non-finite gradients give non-finite weights until restored.

    >>> p = torch.nn.Parameter(torch.zeros(2)); p.grad = torch.tensor([3.0, 4.0])
    >>> moved, saved = perturb([p], rho=1.0)
    >>> p.tolist(), saved[0].tolist()
    ([0.6000000238418579, 0.800000011920929], [0.0, 0.0])
    """
    _check(rho, epsilon)
    moved = [p for p in params if p.grad is not None]
    if not moved:
        return [], []
    saved = [p.detach().clone() for p in moved]
    grads = [p.grad for p in moved]
    scale = rho / (torch.nn.utils.get_total_norm(grads, 2.0) + epsilon)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, p in enumerate(moved):
        groups.setdefault((p.device, p.dtype), []).append(i)
    for (device, dtype), index in groups.items():
        s = scale.to(device=device, dtype=dtype)
        torch._foreach_add_([moved[i].detach() for i in index], torch._foreach_mul([grads[i] for i in index], s))
    return moved, saved


@torch.no_grad()
def restore(params: list[Tensor], saved: list[Tensor]) -> None:
    """Put back the weights :func:`perturb` saved (a copy: exactly the weights before)."""
    if params:
        torch._foreach_copy_([p.detach() for p in params], saved)


def sam_step(
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer,
    closure: Callable[[], Tensor],
    rho: float = 0.05,
    epsilon: float = 1e-12,
) -> Tensor:
    """One SAM step in a loop of your own; returns the loss at the current weights.

    ``closure()`` computes the loss of the batch at the model's current weights, calls
    ``backward()`` on it and returns it (Composer's and torch's closure). Gradients
    should be zero (``optimizer.zero_grad()``) before. The closure runs twice: at ``w``,
    then at ``w + e``; the weights go back to ``w`` and ``optimizer.step()`` uses the
    second gradients, which are left in ``.grad``. With ``model`` given, its buffers
    (batch-norm statistics) are kept as the first pass left them.

    >>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> x, y = torch.ones(4, 2), torch.zeros(4, 1)
    >>> def closure():
    ...     loss = torch.nn.functional.mse_loss(model(x), y); loss.backward(); return loss
    >>> loss = sam_step(model, opt, closure)
    """
    _check(rho, epsilon)
    with torch.enable_grad():
        loss = closure()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    with _buffers_kept(model):
        moved, saved = perturb(params, rho, epsilon)
        for p in moved:
            p.grad = None
        try:
            with torch.enable_grad():
                closure()
        finally:
            restore(moved, saved)
    optimizer.step()
    return loss


class _buffers_kept:
    """Within: buffers of ``model`` may change; after: they are as they were."""

    def __init__(self, model: nn.Module | None) -> None:
        self.buffers = [b for b in model.buffers()] if model is not None else []

    def __enter__(self) -> None:
        self.saved = [b.detach().clone() for b in self.buffers]

    def __exit__(self, *exc: Any) -> None:
        if self.buffers:
            with torch.no_grad():
                torch._foreach_copy_(self.buffers, self.saved)


def _autocast_now(device_type: str) -> tuple[str, bool, torch.dtype]:
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _autocast(captured: tuple[str, bool, torch.dtype] | None) -> Any:
    if captured is None or not captured[1]:
        return nullcontext()
    return torch.autocast(captured[0], dtype=captured[2])


class Sam(Algorithm):
    """Sharpness-aware minimisation: step with the gradient at weights perturbed by rho along it."""

    name = "sam"
    config_class = SamConfig
    # mixed_precision's init sets state.compute_dtype first (fp16 is refused at init).
    runs_after = ("mixed_precision",)
    conflicts_with = {
        "grad_accumulation": (
            "SAM perturbs the weights along the gradient of the batch it has just computed, but under "
            "accumulation .grad holds the group's sum so far, and a SAM step over the group would need "
            "every batch of the group again at the perturbed weights; use a bigger batch or sam alone"
        ),
        "fsdp": (
            "SAM's perturbation and exact restore of sharded (DTensor) parameters under FSDP2 are not "
            "verified; use DDP (the default) with sam"
        ),
    }

    def __init__(self, config: SamConfig | None = None) -> None:
        super().__init__(config)
        self._forward_autocast: tuple[str, bool, torch.dtype] | None = None
        self._loss_autocast: tuple[str, bool, torch.dtype] | None = None
        self._loss_fn: Callable[..., Tensor] | None = None

    @hookimpl
    def init(self, state: State) -> None:
        if state.compute_dtype == torch.float16:
            raise ConfigError(
                "algorithms.sam: does not work with fp16 loss scaling (algorithms.mixed_precision.dtype=fp16, "
                "or auto where it chose fp16): its second backward would not be scaled by the GradScaler; "
                "use algorithms.mixed_precision.dtype=bf16"
            )

    # -- what the second pass needs, captured innermost during the first ------------------

    @hookimpl(wrapper=True, trylast=True)
    def forward(self, state: State) -> Iterator[None]:
        if state.training:
            self._forward_autocast = _autocast_now(state.device.type)
        return (yield)

    @hookimpl(wrapper=True, trylast=True)
    def compute_loss(self, state: State) -> Iterator[None]:
        self._loss_autocast = _autocast_now(state.device.type)
        self._loss_fn = state.loss_fn  # label_smoothing's, while it swaps it in
        return (yield)

    # -- the SAM step ------------------------------------------------------------------

    @hookimpl(wrapper=True)
    def backward(self, state: State) -> Iterator[None]:
        cfg = self.config
        apply = sam_applies(state.timestamp.optimizer_steps, cfg.interval)
        params = [p for group in state.optimizer.param_groups for p in group["params"]]
        if apply and any(p.grad is not None for p in params):
            raise ConfigError(
                "algorithms.sam: gradients were already accumulated before this batch's backward (a plugin "
                "whose should_step skips steps); SAM needs each step's gradient alone"
            )
        result = yield  # the first pass: the gradient at w, by whoever does backward
        if not apply:
            return result
        with _buffers_kept(state.unwrapped_model):
            moved, saved = perturb(params, cfg.rho, cfg.epsilon)
            for p in moved:
                p.grad = None
            try:
                loss = self._second_pass(state)
            finally:
                restore(moved, saved)
        state.metrics["sam_loss"] = loss.detach()  # the loss at w + e (read at the logging interval)
        return result

    def _second_pass(self, state: State) -> Tensor:
        inputs, targets = state.batch[0], state.batch[1]
        with torch.enable_grad():
            with _autocast(self._forward_autocast):
                outputs = state.model(inputs)
            with _autocast(self._loss_autocast):
                loss = (self._loss_fn or state.loss_fn)(outputs, targets)
            loss = loss.float()
            loss.backward()
        return loss

    @hookimpl
    def fit_end(self, state: State) -> None:
        state.summary["sam_steps"] = state.timestamp.optimizer_steps // self.config.interval


__all__ = ["Sam", "SamConfig", "perturb", "restore", "sam_applies", "sam_step"]
