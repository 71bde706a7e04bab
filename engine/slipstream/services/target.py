"""Time to a target accuracy, and an optional stop there (as MLPerf and DAWNBench
runs do): the speed claim of a technique is the time to reach the same accuracy."""

from __future__ import annotations

from typing import Any

from slipstream.hookspecs import hookimpl
from slipstream.state import State

STATUS = "target_reached"


class TargetAccuracy:
    name = "engine.target"

    def __init__(self, target: float, stop: bool = False) -> None:
        self.target = target
        self.stop = stop
        self.reached_s: float | None = None
        self.metrics: Any = None  # the metrics log (set by the Trainer): its eval record's elapsed_s

    # trylast: after the metrics logger wrote the eval record, whose elapsed_s this
    # reuses, so summary.json and metrics.jsonl agree to the digit.
    @hookimpl(trylast=True)
    def eval_end(self, state: State) -> None:
        if self.reached_s is not None:
            return
        accuracy = state.eval_metrics.get("accuracy")
        if accuracy is None or accuracy < self.target:
            return
        record = self.metrics.last.get("eval") if self.metrics is not None else None
        self.reached_s = record["elapsed_s"] if record else round(state.tick(), 4)
        # At the end of the run (the final evaluation) there is nothing left to stop.
        if self.stop and not state.is_done():
            state.request_stop(
                STATUS,
                f"reached the target accuracy {100 * self.target:.2f} % "
                f"({100 * accuracy:.2f} %) at {self.reached_s:.1f} s",
            )
