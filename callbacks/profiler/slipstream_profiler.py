"""torch.profiler over a few training steps chosen by config: a Chrome/Perfetto
trace and a table of the top ops under ``RUN_DIR/profiler/``."""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from slipstream import Callback, State, hookimpl

FOLDER = "profiler"
TABLE = "top_ops.txt"


@dataclass
class ProfilerConfig:
    wait: int = 1  # steps skipped first (the first step pays one-off costs)
    warmup: int = 1  # steps traced but thrown away (the profiler's own start-up)
    active: int = 3  # steps recorded
    repeat: int = 1  # cycles of wait + warmup + active (0: until the run ends)
    record_shapes: bool = False  # input shapes of each op (a larger trace)
    profile_memory: bool = False  # allocations per op
    with_stack: bool = False  # Python stacks in the trace (much larger)
    row_limit: int = 15  # rows of the top-ops table
    sort_by: Optional[str] = None  # None: self_cuda_time_total on CUDA, else self_cpu_time_total

    def __post_init__(self) -> None:
        for key in ("wait", "warmup", "repeat"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must be 0 or more, got {getattr(self, key)}")
        if self.active < 1:
            raise ValueError(f"active must be at least 1 step, got {self.active}")
        if self.row_limit < 1:
            raise ValueError(f"row_limit must be at least 1, got {self.row_limit}")


class Profiler(Callback):
    """torch.profiler over chosen steps: a Chrome/Perfetto trace and a top-ops table."""

    name = "profiler"
    config_class = ProfilerConfig

    def __init__(self, config: ProfilerConfig | None = None) -> None:
        super().__init__(config)
        self.prof: Any = None
        self.folder: Path | None = None
        self.traces: list[Path] = []
        self._steps = 0

    @hookimpl
    def fit_start(self, state: State) -> None:
        if state.rank != 0:  # one process's profile is the picture; only rank 0 writes
            return
        cfg = self.config
        self.folder = Path(state.run_dir) / FOLDER
        activities = [ProfilerActivity.CPU]
        if state.device.type == "cuda" and torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.sort_by = cfg.sort_by or (
            "self_cuda_time_total" if ProfilerActivity.CUDA in activities else "self_cpu_time_total"
        )
        self.prof = profile(
            activities=activities,
            schedule=schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=cfg.repeat),
            on_trace_ready=self._write,
            record_shapes=cfg.record_shapes,
            profile_memory=cfg.profile_memory,
            with_stack=cfg.with_stack,
        )
        self.prof.start()

    @hookimpl
    def batch_end(self, state: State) -> None:
        if self.prof is None:
            return
        self.prof.step()
        self._steps += 1
        cfg = self.config
        if cfg.repeat and self._steps >= (cfg.wait + cfg.warmup + cfg.active) * cfg.repeat:
            self._stop()  # every cycle is written: profile no further

    def _write(self, prof: Any) -> None:
        """The profiler's on_trace_ready: one trace and one table per cycle."""
        assert self.folder is not None
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"trace-step{self._steps}.json"
        prof.export_chrome_trace(str(trace))
        self.traces.append(trace)
        table = prof.key_averages().table(sort_by=self.sort_by, row_limit=self.config.row_limit)
        (self.folder / TABLE).write_text(table + "\n")
        print(
            f"slipstream: profiler: steps up to {self._steps}, trace {trace} "
            f"(open in https://ui.perfetto.dev or chrome://tracing)\n{table}",
            file=sys.stderr,
        )

    @hookimpl
    def fit_end(self, state: State) -> None:
        self._stop()
        if state.rank == 0 and not self.traces:
            cfg = self.config
            warnings.warn(
                f"slipstream: profiler: the run ended after {self._steps} steps, before any were "
                f"recorded (wait={cfg.wait} + warmup={cfg.warmup}); no trace was written",
                stacklevel=2,
            )

    @hookimpl
    def exception(self, state: State) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.stop()  # a cycle cut short by the end of the run is still written
