"""A tqdm progress bar over the run, with the last logged loss and accuracy."""

from __future__ import annotations

import math
import sys
from typing import Any

from tqdm.auto import tqdm

from ..hookspecs import hookimpl
from ..state import State


class ProgressBar:
    name = "engine.progress"

    def __init__(self, file: Any = None) -> None:
        self.file = file
        self.bar: Any = None
        self._wall_clock = False

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
            mininterval=0.5,
            file=self.file or sys.stderr,
            leave=True,
        )

    @hookimpl
    def batch_end(self, state: State) -> None:
        if self.bar is None:
            return
        if self._wall_clock:
            self.bar.update(int(state.tick()) - self.bar.n)
        else:
            self.bar.update(1)
        if state.timestamp.batch % 10 == 0:
            self._postfix(state)

    def _postfix(self, state: State) -> None:
        last = state.stash.get("engine.metrics", {})
        fields = {"ep": state.timestamp.epoch}
        if "train" in last:
            fields["loss"] = f"{last['train']['loss']:.3f}"
        if "eval" in last:
            fields["acc"] = f"{100 * last['eval']['accuracy']:.1f}%"
        self.bar.set_postfix(fields, refresh=False)

    @hookimpl(trylast=True)
    def fit_end(self, state: State) -> None:
        if self.bar is not None:
            self._postfix(state)
            self.bar.close()
            self.bar = None

    @hookimpl
    def exception(self, state: State) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
