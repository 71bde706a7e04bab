"""Stop (or warn) when the training loss stops being a finite number.

Each step's loss stays on the device; the losses of an interval are read together
at the logging interval, where the metrics log already waits for the device, and
before every checkpoint, so the loop never syncs per step and a checkpoint is
never written after an unnoticed NaN.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..hookspecs import hookimpl
from ..interval import Interval
from ..state import State
from .losses import stack_losses

ON_NONFINITE = ("stop", "warn")


def check_on_nonfinite(value: str) -> str:
    """``value`` if it is a valid ``trainer.on_nonfinite``, else a ConfigError."""
    if value not in ON_NONFINITE:
        raise ConfigError(
            f"trainer.on_nonfinite must be one of {', '.join(ON_NONFINITE)}, got {value!r}"
        )
    return value


def _number_text(value: float) -> str:
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


class DivergenceMonitor:
    name = "engine.divergence"

    def __init__(self, log_interval: int = 20, on_nonfinite: str = "stop") -> None:
        self.log_interval = log_interval
        self._every = Interval(log_interval)
        self.on_nonfinite = check_on_nonfinite(on_nonfinite)
        self._losses: list[torch.Tensor] = []
        self._steps: list[int] = []
        self.nonfinite_steps = 0

    @hookimpl
    def fit_start(self, state: State) -> None:
        self._every = Interval.after(self.log_interval, state.timestamp.batch)

    @hookimpl
    def after_loss(self, state: State) -> None:
        # A reference to the device scalar, nothing read: no sync here.
        self._losses.append(state.loss.detach())
        self._steps.append(state.timestamp.batch + 1)  # the step this batch completes

    @hookimpl
    def batch_end(self, state: State) -> None:
        if self._every.due(state.timestamp.batch):
            self.check(state)

    def check(self, state: State) -> bool:
        """Read the losses since the last check; False when the run has diverged
        and must write no more checkpoints (always True with ``warn``)."""
        if state.stop_status == "diverged":
            return False
        if self._losses:
            # The one sync per interval: a few floats read to the host, where checking
            # them costs less than launching kernels to check them on the device.
            values = stack_losses(self._losses).tolist()
            steps, self._losses, self._steps = self._steps, [], []
            bad = [i for i, value in enumerate(values) if not math.isfinite(value)]
            any_bad = bool(bad)
            if dist.is_available() and dist.is_initialized() and state.world_size > 1:
                # Every rank must stop at the same batch, or the next collective hangs.
                flag = torch.tensor([len(bad)], dtype=torch.int64, device=state.device)
                dist.all_reduce(flag)
                any_bad = int(flag.item()) > 0
            if any_bad:
                self._report(state, values, bad, steps)
        return state.stop_status != "diverged"

    def _report(self, state: State, losses: list[float], bad: list[int], steps: list[int]) -> None:
        if not bad:  # another rank saw it
            first_step, value = steps[-1], "nan"
            where = "on another rank"
        else:
            first_step, value = steps[bad[0]], _number_text(losses[bad[0]])
            where = ""
        first = self.nonfinite_steps == 0
        self.nonfinite_steps += max(len(bad), 1)
        record = state.summary.setdefault(
            "nonfinite_loss", {"first_step": first_step, "first_value": value}
        )
        record["steps"] = self.nonfinite_steps
        message = f"the training loss is {value} at step {first_step}{' ' + where if where else ''}"
        if self.on_nonfinite == "stop":
            state.request_stop(
                "diverged",
                f"diverged: {message}; stopped, and no checkpoint of the diverged weights was "
                "written (lower optimizer.lr, add grad_clipping, or set "
                "trainer.on_nonfinite=warn to train on)",
            )
        elif first:
            warnings.warn(
                f"slipstream: {message}; training on (trainer.on_nonfinite=warn), and no "
                "checkpoint is written while the weights are not finite",
                RuntimeWarning,
                stacklevel=2,
            )
