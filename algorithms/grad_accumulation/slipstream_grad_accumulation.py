"""Gradient accumulation: step the optimizer once every N batches, so a batch N times
smaller trains like the big one while holding a quarter (for N=4) of the activations.

Groups of N batches are cut from the start of each epoch; the last group of an epoch
(and of a run whose length is known in ep, ba or sp) may be shorter and still steps,
so no gradient crosses an epoch boundary. The loss of each batch is divided by the
size of its group, so a group's gradient is the mean over its batches, as one big
batch's would be.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import nn

from slipstream import Algorithm, State, check_plugin_options, hookimpl, plugin_option, unwrap_model


@dataclass
class GradAccumulationConfig:
    steps: int = plugin_option(4, low=1, whole=True, note="batches per optimizer step")

    def __post_init__(self) -> None:
        check_plugin_options(self)


class AccumulationPlan(NamedTuple):
    divisor: int  # batches in this batch's group: its loss is divided by this
    step: bool  # whether the optimizer steps after this batch


def accumulation_plan(position: int, steps: int, batches_left: int | None = None) -> AccumulationPlan:
    """What to do with the batch at ``position`` (0-based) when groups of ``steps``
    batches start at multiples of ``steps``.

    ``batches_left`` counts the batches, this one included, before a step is forced
    (the end of the epoch or of the run); ``None`` when unknown. A group cut short by
    it is smaller, and its losses are divided by its real size.

    >>> accumulation_plan(3, 4)
    AccumulationPlan(divisor=4, step=True)
    >>> [tuple(accumulation_plan(p, 4, batches_left=6 - p)) for p in (4, 5)]  # 6-batch epoch
    [(2, False), (2, True)]
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    done = position % steps  # batches of this group before this one
    rest = steps - done
    if batches_left is not None:
        rest = min(rest, max(batches_left, 1))
    return AccumulationPlan(divisor=done + rest, step=rest == 1)


def _batches_left(state: State) -> int | None:
    """Batches left before the end of the epoch or the run, this one included."""
    ts, total = state.timestamp, state.max_duration
    bpe = state.batches_per_epoch
    left = [bpe - ts.batch_in_epoch] if bpe else []
    per_batch = {"ba": 1.0, "ep": 1.0 / bpe if bpe else None, "sp": state.global_batch_size}.get(total.unit)
    if per_batch:  # a wall-clock run's end cannot be foreseen
        left.append(math.ceil((total.value - state.time_in(total.unit)) / per_batch - 1e-9))
    return min(left) if left else None


def _find_ddp(model: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    while model is not None and not isinstance(model, nn.parallel.DistributedDataParallel):
        model = getattr(model, "_orig_mod", None)  # torch.compile around DDP
    return model


@contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Skip the gradient reduction of the backward passes inside: DDP's ``no_sync()``,
    or FSDP2's ``set_requires_gradient_sync(False)`` (gradients then accumulate
    unsharded until the next backward that syncs). Nothing for a model in one process."""
    ddp = _find_ddp(model)
    if ddp is not None:
        with ddp.no_sync():
            yield
        return
    sharded = unwrap_model(model)
    if not hasattr(sharded, "set_requires_gradient_sync"):  # not an FSDP2 module
        yield
        return
    sharded.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        sharded.set_requires_gradient_sync(True)


class GradAccumulation(Algorithm):
    """Step the optimizer every N batches with the loss divided by N (no all-reduce in between)."""

    name = "grad_accumulation"
    config_class = GradAccumulationConfig

    def __init__(self, config: GradAccumulationConfig | None = None) -> None:
        super().__init__(config)
        self._step = True
        self._pending = 0  # batches accumulated since the last step
        self._lost = 0  # batches of the current group whose gradients a resume lost

    def _position(self, state: State) -> int:
        # Groups restart with each epoch when its length is known (so they never span
        # two), and run over the whole training otherwise.
        ts = state.timestamp
        return ts.batch_in_epoch if state.batches_per_epoch else ts.batch

    @hookimpl
    def fit_start(self, state: State) -> None:
        # Gradients are not checkpointed: a run resumed mid-group finishes that group
        # with the batches that remain, averaged over those alone.
        self._lost = self._position(state) % self.config.steps
        self._pending = 0
        if state.global_batch_size:
            state.summary["effective_batch_size"] = state.global_batch_size * self.config.steps

    @hookimpl(wrapper=True)
    def backward(self, state: State) -> Any:
        plan = accumulation_plan(self._position(state), self.config.steps, _batches_left(state))
        self._step = plan.step
        loss = state.loss
        divisor = plan.divisor - self._lost
        if divisor > 1:
            state.loss = loss / divisor  # whoever does the backward (a GradScaler too) sees this
        try:
            with nullcontext() if plan.step else no_gradient_sync(state.model):
                return (yield)
        finally:
            state.loss = loss  # after_backward and later see the batch's own loss
            if plan.step:
                self._lost, self._pending = 0, 0
            else:
                self._pending += 1

    @hookimpl
    def should_step(self, state: State) -> bool:
        return self._step

    @hookimpl
    def fit_end(self, state: State) -> None:
        # A wall-clock or interrupted run may end inside a group: its gradients are dropped.
        if self._pending:
            state.optimizer.zero_grad(set_to_none=True)
            state.summary["grad_accumulation_dropped_batches"] = self._pending
            self._pending = 0


__all__ = [
    "AccumulationPlan",
    "GradAccumulation",
    "GradAccumulationConfig",
    "accumulation_plan",
    "no_gradient_sync",
]
