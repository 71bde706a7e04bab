"""Stop (or warn) when the training loss stops being a finite number.

Each step's loss stays on the device (:mod:`slipstream.services.losses` keeps it);
the losses of an interval are read together at the logging interval, where the
metrics log already waits for the device, and before every checkpoint, and this
monitor looks at every value read: the loop never syncs per step, and a checkpoint
is never written after an unnoticed NaN. The losses are read before every evaluation
too, and the weights are looked at there and at the end of the run: no evaluation
runs on weights that are not finite, and a run whose final weights are not finite
ends ``diverged``, whatever ``on_nonfinite`` says. At the first non-finite loss it
says where the run went non-finite (:mod:`slipstream.services.nonfinite`), looked at
then and only then.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist

from slipstream.errors import describe
from slipstream.services.losses import TrainLosses
from slipstream.services.nonfinite import locate
from slipstream.state import State


def _number_text(value: float) -> str:
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


class DivergenceMonitor:
    """Looks at every loss :class:`~slipstream.services.losses.TrainLosses` reads
    (it is that keeper's inspector): the metrics log reads them every
    ``log_interval`` batches, and :meth:`check` before every checkpoint. Not a
    plugin: it has nothing to do at any event."""

    def __init__(self, losses: TrainLosses, on_nonfinite: str = "stop") -> None:
        self.on_nonfinite = on_nonfinite  # checked with the run's options
        self.losses = losses
        losses.inspector = self.inspect
        self.nonfinite_steps = 0

    def before_evaluation(self, state: State) -> bool:
        """Whether an evaluation may run now: the losses since the last read are
        finite (or ``warn``) and so are the weights. Costs one device sync, which the
        evaluation that follows pays anyway."""
        return self.check(state) and self._weights_ok(state)

    def finish(self, state: State) -> None:
        """At the end of the loop, before the final evaluation: read the last
        losses, then refuse to call weights that are not finite ``completed``."""
        if state.stop_status != "interrupted" and self.check(state):
            self._weights_ok(state, final=True)

    def _weights_ok(self, state: State, final: bool = False) -> bool:
        """True when the weights are finite. Otherwise ``stop`` stops the run as
        diverged; ``warn`` trains on with no evaluation, and the run ends diverged."""
        if weights_finite(state):
            return True
        step = state.timestamp.batch
        first = "nonfinite_weights" not in state.summary
        state.summary.setdefault("nonfinite_weights", {"first_step": step})
        if self.on_nonfinite == "stop" or final:
            since = state.summary["nonfinite_weights"]["first_step"]
            state.request_stop(
                "diverged",
                f"diverged: the model's weights are not finite (seen at step {since}); no "
                "evaluation of them and no checkpoint (lower optimizer.lr or add grad_clipping)",
            )
        elif first:
            warnings.warn(
                f"slipstream: the model's weights are not finite at step {step}; training on "
                "(trainer.on_nonfinite=warn) without evaluating them, and the run will end diverged",
                RuntimeWarning,
                stacklevel=2,
            )
        return False

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
                "hint": "lower optimizer.lr or add grad_clipping",
            }
        state.summary["nonfinite_at"] = {k: v for k, v in found.items() if k != "message"}
        message = f"{message}; {found['message']}"
        if self.on_nonfinite == "stop":
            # The losses are read at intervals (no sync per step): say where the run
            # really stopped, which may be some steps later.
            now = state.timestamp.batch
            stopped = "stopped" if now == first_step else f"stopped at step {now}, where it was read"
            state.request_stop(
                "diverged",
                f"diverged: {message}; {stopped}, and no checkpoint of the diverged weights was "
                f"written ({found['hint']}; or set trainer.on_nonfinite=warn to train on)",
            )
        else:
            warnings.warn(
                f"slipstream: {message}; training on (trainer.on_nonfinite=warn), and no "
                f"checkpoint is written while the weights are not finite ({found['hint']})",
                RuntimeWarning,
                stacklevel=2,
            )


def weights_finite(state: State) -> bool:
    """Whether every parameter of the model is finite (on every rank): one device
    sync. A sharded parameter is looked at through this rank's shard."""
    flags = []
    for param in state.unwrapped_model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        if local.numel() and (local.is_floating_point() or local.is_complex()):
            flags.append(torch.isfinite(local.detach()).all())
    if not flags:
        return True
    ok = torch.stack(flags).all().to(torch.int64).reshape(1)
    if state.world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())
