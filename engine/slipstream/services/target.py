"""Time to a target accuracy, and an optional stop there (as MLPerf and DAWNBench
runs do): the speed claim of a technique is the time to reach the same accuracy."""

from __future__ import annotations

from typing import Any

from slipstream.hookspecs import hookimpl
from slipstream.state import State

STATUS = "target_reached"


class TargetAccuracy:
    name = "engine.target"

    def __init__(self, target: float, stop: bool = False, metric: str = "accuracy", higher: bool = True) -> None:
        self.target = target
        self.stop = stop
        # The eval records' key (another set's metric is SET/METRIC) and its direction:
        # a metric that improves downwards (loss) reaches the target at or below it.
        self.metric = metric
        self.higher = higher
        self.reached_s: float | None = None
        self.metrics: Any = None  # the metrics log (set by the Trainer): its eval record's elapsed_s

    # trylast: after the metrics logger wrote the eval record, whose elapsed_s this
    # reuses, so summary.json and metrics.jsonl agree to the digit.
    @hookimpl(trylast=True)
    def eval_end(self, state: State) -> None:
        if self.reached_s is not None:
            return
        value = state.eval_metrics.get(self.metric)
        if not self.reached(value):
            return
        record = self.metrics.last.get("eval") if self.metrics is not None else None
        self.reached_s = record["elapsed_s"] if record else round(state.tick(), 4)
        # At the end of the run (the final evaluation) there is nothing left to stop.
        if self.stop and not state.is_done():
            if self.metric == "accuracy":
                what = f"the target accuracy {100 * self.target:.2f} % ({100 * value:.2f} %)"
            else:
                what = f"the target {self.metric} {self.target:.4g} ({value:.4g})"
            state.request_stop(STATUS, f"reached {what} at {self.reached_s:.1f} s")

    def reached(self, value: float | None) -> bool:
        """Whether an evaluation's ``value`` of the metric reaches the target."""
        if value is None:
            return False
        return value >= self.target if self.higher else value <= self.target
