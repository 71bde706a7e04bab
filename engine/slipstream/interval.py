"""Every N: the one rule for every periodic action of a run (evaluation,
checkpoints, logging, progress redraws).

An :class:`Interval` is due once each time a clock passes its next mark
(``origin + k * every``); a check that finds several marks passed at once (one
long batch) is due once. :class:`RunInterval` applies it to the run's time in a
:class:`~slipstream.duration.Duration`'s unit, at ``batch_end`` and ``epoch_end``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from slipstream.duration import Duration
from slipstream.state import State

# Run time in epochs is a sum of fractions (epoch + batch / batches): a mark is
# reached when the time is this close to it.
_EPS = 1e-9


@dataclass
class Interval:
    """Due at the marks ``origin + k * every`` of a clock (``every <= 0``: always due).

    ``next`` is the first mark to wait for; by default ``origin + every``.

    >>> every_3 = Interval(3)
    >>> [step for step in range(1, 10) if every_3.due(step)]
    [3, 6, 9]
    """

    every: float
    origin: float = 0.0
    next: float | None = None

    def __post_init__(self) -> None:
        if self.next is None:
            self.next = self.origin + self.every

    @classmethod
    def after(cls, every: float, now: float) -> Interval:
        """Marks at the multiples of ``every``, waiting for the first one after ``now``
        (a resumed run keeps the marks of the run it continues)."""
        interval = cls(every)
        interval.next = cls._mark_after(interval, now)
        return interval

    def _mark_after(self, now: float) -> float:
        passed = math.floor((now + _EPS - self.origin) / self.every)
        return self.origin + (passed + 1) * self.every

    def due(self, now: float) -> bool:
        """Whether ``now`` has reached the next mark; if so, wait for the one after ``now``."""
        if self.every <= 0:
            return True
        if now + _EPS < self.next:
            return False
        self.next = self._mark_after(now)
        return True


class RunInterval:
    """An "every N" of run time for a service that acts at ``batch_end`` and
    ``epoch_end`` (``None``: never due).

    Intervals in epochs may be fractional (``0.5ep``): a mark inside an epoch is
    due at the ``batch_end`` that reaches it; a mark at an epoch's end is due at its
    ``epoch_end`` (after the epoch counter moved), not at its last ``batch_end``.
    """

    def __init__(self, every: Duration | str | None) -> None:
        self.every = Duration.parse(every) if every else None
        self._interval: Interval | None = None
        # Whether a mark can fall inside an epoch, so that batch_end must ask: every
        # interval but none and a whole number of epochs (those marks are epoch
        # ends). Most runs evaluate and checkpoint per epoch: their batch_end check
        # is this one attribute.
        self.mid_epoch = self.every is not None and not (
            self.every.unit == "ep" and float(self.every.value).is_integer()
        )

    @property
    def enabled(self) -> bool:
        return self.every is not None

    def start(self, state: State) -> None:
        """Wait for the first mark after the run's current time (call at fit_start)."""
        if self.every is not None:
            self._interval = Interval.after(self.every.value, state.time_in(self.every.unit))

    def _due(self, state: State) -> bool:
        if self.every is None:
            return False
        if self._interval is None:
            self.start(state)
        return self._interval.due(state.time_in(self.every.unit))

    def due_at_batch_end(self, state: State) -> bool:
        """Whether a mark inside the epoch is reached at this batch_end.

        >>> [RunInterval(every).mid_epoch for every in (None, "2ep", "0.5ep", "100ba", "60s")]
        [False, False, True, True, True]
        """
        if not self.mid_epoch:
            return False
        if self.every.unit == "ep":
            per_epoch = state.batches_per_epoch
            if not per_epoch or state.timestamp.batch_in_epoch >= per_epoch:
                return False  # the epoch ends here: epoch_end decides
        return self._due(state)

    def due_at_epoch_end(self, state: State) -> bool:
        return self.every is not None and self.every.unit == "ep" and self._due(state)
