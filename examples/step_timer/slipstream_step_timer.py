"""An example third-party Slipstream plugin, written from the public API alone.

It times every training step on the host (no device sync per step: the times of
asynchronous devices smooth out over the logging interval) and reports the median
and 90th-percentile step time in ``metrics.jsonl`` and ``summary.json``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from slipstream import Algorithm, State, hookimpl


@dataclass
class StepTimerConfig:
    skip_first: int = 2  # warm-up steps left out of the statistics

    def __post_init__(self) -> None:
        if self.skip_first < 0:
            raise ValueError(f"skip_first must be 0 or more, got {self.skip_first}")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) of values, by linear interpolation."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class StepTimer(Algorithm):
    """Reports median and p90 training step time (example third-party plugin)."""

    name = "step_timer"
    config_class = StepTimerConfig

    def __init__(self, config: StepTimerConfig | None = None) -> None:
        super().__init__(config)
        self.step_ms: list[float] = []
        self._started = 0.0
        self._seen = 0

    @hookimpl
    def batch_start(self, state: State) -> None:
        self._started = time.perf_counter()

    @hookimpl
    def batch_end(self, state: State) -> None:
        self._seen += 1
        if self._seen > self.config.skip_first:
            self.step_ms.append(1000 * (time.perf_counter() - self._started))
            state.metrics["step_ms"] = self.step_ms[-1]

    @hookimpl
    def fit_end(self, state: State) -> None:
        if self.step_ms:
            state.summary["step_time_ms"] = {
                "median": statistics.median(self.step_ms),
                "p90": percentile(self.step_ms, 90),
                "steps": len(self.step_ms),
            }
