"""The training loss of every batch, kept for the services that report on it.

Each batch's loss stays on the device as a reference (no sync); a read takes every
loss kept since the last one to the host at once, where the divergence check looks
at each value and the metrics log sums them. One keeper for both, so a batch pays
for one ``after_loss`` and an interval for one device sync, whoever reads first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from slipstream.errors import ConfigError
from slipstream.hookspecs import hookimpl
from slipstream.services.steps import not_a_loss
from slipstream.state import State

# Losses kept as references before they are stacked into one vector (on the device,
# no sync), so that a long interval holds few Python objects.
FOLD = 256

# Told the values of every read, with the step of each: ``(state, values, steps)``.
Inspector = Callable[[State, list[float], list[int]], None]


def stack_losses(losses: list[torch.Tensor]) -> torch.Tensor:
    """The losses as one float vector, on their device (no sync).

    One ``stack`` (dtypes promote, so bf16 and fp32 losses mix); a per-loss reshape
    only when their shapes differ (a loss function returning ``()`` for some batches
    and ``(1,)`` for others), which costs some microseconds a loss.
    """
    try:
        return torch.stack(losses).float().reshape(len(losses))
    except RuntimeError:
        return torch.stack([loss.float().reshape(()) for loss in losses])


def host_values(losses: list[torch.Tensor]) -> list[float]:
    """The losses as floats on the host: one ``stack`` and one copy when every loss
    is a single number of one shape (the usual case, read at every logging
    interval), else through :func:`stack_losses`. Each torch call costs microseconds
    in a loop of small steps, so the usual case makes two, not four."""
    try:
        values = torch.stack(losses).tolist()
    except RuntimeError:  # shapes differ
        values = None
    if values is None or type(values[0]) is not float:  # (1,)-shaped or mixed losses
        return stack_losses(losses).tolist()
    return values


class TrainLosses:
    """Keeps each batch's loss; :meth:`read` brings them to the host.

    Every read is shown to the ``inspector`` (the divergence check) before anyone
    uses the values, so no reader can consume a NaN unnoticed. :meth:`take_mean`
    is the metrics log's view: the mean of everything read since it last asked.
    """

    name = "engine.losses"

    def __init__(self, inspector: Inspector | None = None) -> None:
        self.inspector = inspector
        self._kept: list[torch.Tensor] = []
        self._stacked: list[torch.Tensor] = []  # vectors of FOLD losses, oldest first
        self._sum = 0.0
        self._count = 0

    @hookimpl
    def after_loss(self, state: State) -> None:
        kept = self._kept
        try:
            kept.append(state.loss.detach())
        except AttributeError:
            raise ConfigError(not_a_loss(state.loss) or f"the training loss is {state.loss!r}") from None
        if len(kept) >= FOLD:
            self._stacked.append(stack_losses(kept))
            self._kept = []

    def read(self, state: State) -> list[float]:
        """The losses kept since the last read, as floats (one device sync; none when
        nothing is kept). Called at ``batch_end`` or later, so they are the losses of
        the steps up to ``state.timestamp.batch``."""
        if self._stacked:
            if self._kept:
                self._stacked.append(stack_losses(self._kept))
            values = torch.cat(self._stacked).tolist()
        elif self._kept:
            values = host_values(self._kept)
        else:
            return []
        self._kept, self._stacked = [], []
        self._sum += sum(values)
        self._count += len(values)
        if self.inspector is not None:
            last = state.timestamp.batch
            self.inspector(state, values, list(range(last - len(values) + 1, last + 1)))
        return values

    def state_dict(self) -> dict[str, float]:
        """The losses not yet taken by :meth:`take_mean` (the metrics log's open window),
        so that a resumed run's first record averages the same batches as an
        uninterrupted run's. Read without taking them: nothing is inspected twice."""
        pending = [*self._stacked, stack_losses(self._kept)] if self._kept else list(self._stacked)
        values = torch.cat(pending).tolist() if pending else []
        return {"sum": self._sum + sum(values), "count": self._count + len(values)}

    def load_state_dict(self, state: dict[str, float] | None) -> None:
        """The open window of the run a resume continues (None: a checkpoint without one)."""
        if state:
            self._sum, self._count = float(state["sum"]), int(state["count"])

    def take_mean(self, state: State) -> float | None:
        """The mean loss of the steps since the last call (None: no step since)."""
        self.read(state)
        if not self._count:
            return None
        mean = self._sum / self._count
        self._sum, self._count = 0.0, 0
        return mean
