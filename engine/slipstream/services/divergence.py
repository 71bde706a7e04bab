"""Stop (or warn) when the training loss stops being a finite number.

Each step's loss stays on the device (:mod:`slipstream.services.losses` keeps it);
the losses of an interval are read together at the logging interval, where the
metrics log already waits for the device, and before every checkpoint, and this
monitor looks at every value read: the loop never syncs per step, and a checkpoint
is never written after an unnoticed NaN. At the first non-finite loss it says where
the run went non-finite (:mod:`slipstream.services.nonfinite`), looked at then and
only then.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist

from ..errors import ConfigError, describe
from ..state import State
from .losses import TrainLosses
from .nonfinite import locate

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
    """Looks at every loss :class:`~slipstream.services.losses.TrainLosses` reads
    (it is that keeper's inspector): the metrics log reads them every
    ``log_interval`` batches, and :meth:`check` before every checkpoint. Not a
    plugin: it has nothing to do at any event."""

    def __init__(self, losses: TrainLosses, on_nonfinite: str = "stop") -> None:
        self.on_nonfinite = check_on_nonfinite(on_nonfinite)
        self.losses = losses
        losses.inspector = self.inspect
        self.nonfinite_steps = 0

    def check(self, state: State) -> bool:
        """Read the losses since the last read; False when the run has diverged
        and must write no more checkpoints (always True with ``warn``)."""
        if state.stop_status != "diverged":
            self.losses.read(state)
        return state.stop_status != "diverged"

    def inspect(self, state: State, values: list[float], steps: list[int]) -> None:
        """Stop or warn if a value is not finite (on any rank). Read on the host:
        checking a few floats there costs less than launching kernels to check them
        on the device, and the read was the sync anyway."""
        # A finite sum means every value is finite (a NaN or an infinity never sums to
        # a finite number): one C loop over the floats in the usual case.
        bad = [] if math.isfinite(sum(values)) else [i for i, v in enumerate(values) if not math.isfinite(v)]
        any_bad = bool(bad)
        if state.world_size > 1 and dist.is_available() and dist.is_initialized():
            # Every rank must stop at the same batch, or the next collective hangs.
            flag = torch.tensor([len(bad)], dtype=torch.int64, device=state.device)
            dist.all_reduce(flag)
            any_bad = int(flag.item()) > 0
        if any_bad:
            self._report(state, values, bad, steps)

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
        if not first:
            return
        # Where it went non-finite, looked at once (a sync and a look at the
        # parameters): never while the losses are finite.
        try:
            found = locate(state)
        except Exception as exc:  # the report must not fail the run it reports on
            found = {
                "message": f"where it went non-finite was not found ({describe(exc)})",
                "hint": "lower optimizer.lr, add grad_clipping, or set trainer.on_nonfinite=warn "
                "to train on",
            }
        state.summary["nonfinite_at"] = {k: v for k, v in found.items() if k != "message"}
        message = f"{message}; {found['message']}"
        if self.on_nonfinite == "stop":
            state.request_stop(
                "diverged",
                f"diverged: {message}; stopped, and no checkpoint of the diverged weights was "
                f"written ({found['hint']})",
            )
        else:
            warnings.warn(
                f"slipstream: {message}; training on (trainer.on_nonfinite=warn), and no "
                f"checkpoint is written while the weights are not finite ({found['hint']})",
                RuntimeWarning,
                stacklevel=2,
            )
