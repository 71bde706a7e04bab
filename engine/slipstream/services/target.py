"""Time to a target accuracy, and an optional stop there (as MLPerf and DAWNBench
runs do): the speed claim of a technique is the time to reach the same accuracy."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..hookspecs import hookimpl
from ..state import State

STATUS = "target_reached"


def check_target(target_accuracy: Any, stop_at_target: Any) -> float | None:
    """Validate ``trainer.target_accuracy`` / ``trainer.stop_at_target``; returns the
    target as a float (None when not set)."""
    if not isinstance(stop_at_target, bool):
        raise ConfigError(f"trainer.stop_at_target must be true or false, got {stop_at_target!r}")
    if target_accuracy is None:
        if stop_at_target:
            raise ConfigError(
                "trainer.stop_at_target needs trainer.target_accuracy, e.g. trainer.target_accuracy=0.9"
            )
        return None
    number = isinstance(target_accuracy, (int, float)) and not isinstance(target_accuracy, bool)
    if not number or not 0 < target_accuracy <= 1:
        raise ConfigError(
            "trainer.target_accuracy must be a fraction in (0, 1] (0.9 for 90 %), "
            f"got {target_accuracy!r}"
        )
    return float(target_accuracy)


class TargetAccuracy:
    name = "engine.target"

    def __init__(self, target: float, stop: bool = False) -> None:
        self.target = target
        self.stop = stop
        self.reached_s: float | None = None

    # trylast: after the metrics logger wrote the eval record, whose elapsed_s this
    # reuses, so summary.json and metrics.jsonl agree to the digit.
    @hookimpl(trylast=True)
    def eval_end(self, state: State) -> None:
        if self.reached_s is not None:
            return
        accuracy = state.eval_metrics.get("accuracy")
        if accuracy is None or accuracy < self.target:
            return
        record = state.stash.get("engine.metrics", {}).get("eval")
        self.reached_s = record["elapsed_s"] if record else round(state.tick(), 4)
        # At the end of the run (the final evaluation) there is nothing left to stop.
        if self.stop and not state.is_done():
            state.request_stop(
                STATUS,
                f"reached the target accuracy {100 * self.target:.2f} % "
                f"({100 * accuracy:.2f} %) at {self.reached_s:.1f} s",
            )
