"""A tqdm progress bar over the run, with the last logged loss and accuracy.

It refreshes by time, not by batch: a batch costs one clock read until the refresh
interval has passed, so the bar is free on a loop of many tiny steps."""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from tqdm.auto import tqdm

from slipstream.hookspecs import hookimpl
from slipstream.interval import Interval
from slipstream.state import State

REFRESH_S = 0.5  # seconds between redraws


class ProgressBar:
    name = "engine.progress"

    def __init__(self, file: Any = None, refresh_s: float | None = None, metrics: Any = None) -> None:
        """``metrics``: the metrics log, whose last train and eval records the bar shows
        (None: the epoch only)."""
        self.file = file
        self.metrics = metrics
        self.refresh_s = REFRESH_S if refresh_s is None else refresh_s
        self.bar: Any = None
        self._wall_clock = False
        self._redraw = Interval(self.refresh_s)

    def _total(self, state: State) -> int | None:
        total = state.max_duration
        if total.unit == "ba":
            return int(total.value)
        if total.unit == "ep" and state.batches_per_epoch:
            return math.ceil(total.value * state.batches_per_epoch)
        if total.unit == "sp" and state.global_batch_size:
            return math.ceil(total.value / state.global_batch_size)
        return None

    @hookimpl
    def fit_start(self, state: State) -> None:
        self._wall_clock = state.max_duration.unit == "s"
        unit = "s" if self._wall_clock else "ba"
        total = int(state.max_duration.value) if self._wall_clock else self._total(state)
        self.bar = tqdm(
            total=total,
            initial=int(state.timestamp.elapsed_s if self._wall_clock else state.timestamp.batch),
            unit=unit,
            dynamic_ncols=True,
            # We decide when to draw (refresh_s); tqdm draws whenever asked.
            mininterval=0,
            miniters=1,
            file=self.file or sys.stderr,
            leave=True,
        )
        # The first batch draws; then one redraw per refresh_s.
        now = time.monotonic()
        self._redraw = Interval(self.refresh_s, origin=now, next=now)

    @hookimpl
    def batch_end(self, state: State) -> None:
        if self._redraw.due(time.monotonic()) and self.bar is not None:
            self._refresh(state)

    def _refresh(self, state: State) -> None:
        self._postfix(state)
        position = int(state.tick()) if self._wall_clock else state.timestamp.batch
        self.bar.update(position - self.bar.n)

    def _postfix(self, state: State) -> None:
        last = self.metrics.last if self.metrics is not None else {}
        fields = {"ep": state.timestamp.epoch}
        if "train" in last:
            fields["loss"] = f"{last['train']['loss']:.3f}"
        if "eval" in last:
            fields["acc"] = f"{100 * last['eval']['accuracy']:.1f}%"
        self.bar.set_postfix(fields, refresh=False)

    @hookimpl(trylast=True)
    def fit_end(self, state: State) -> None:
        if self.bar is not None:
            self._refresh(state)
            self.bar.close()
            self.bar = None

    @hookimpl
    def exception(self, state: State) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
