"""torch.profiler over a few training steps chosen by config: a Chrome/Perfetto
trace and a table of the top ops under ``RUN_DIR/profiler/``."""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from slipstream import Callback, State, check_plugin_options, hookimpl, plugin_option

FOLDER = "profiler"
TABLE = "top_ops.txt"


# The columns torch's key_averages().table() sorts by; any other name fails only
# when the table is printed, after the run.
SORT_KEYS = (
    "self_cpu_time_total",
    "cpu_time_total",
    "self_cuda_time_total",
    "cuda_time_total",
    "self_device_time_total",
    "device_time_total",
    "cpu_time",
    "cuda_time",
    "device_time",
    "self_cpu_memory_usage",
    "cpu_memory_usage",
    "self_cuda_memory_usage",
    "cuda_memory_usage",
    "self_device_memory_usage",
    "device_memory_usage",
    "count",
)


@dataclass
class ProfilerConfig:
    # steps skipped first (the first step pays one-off costs)
    wait: int = plugin_option(1, low=0, whole=True)
    # steps traced but thrown away (the profiler's own start-up)
    warmup: int = plugin_option(1, low=0, whole=True)
    active: int = plugin_option(3, low=1, whole=True, note="steps recorded")
    # cycles of wait + warmup + active
    repeat: int = plugin_option(1, low=0, whole=True, note="0: until the run ends")
    record_shapes: bool = False  # input shapes of each op (a larger trace)
    profile_memory: bool = False  # allocations per op
    with_stack: bool = False  # Python stacks in the trace (much larger)
    row_limit: int = plugin_option(15, low=1, whole=True, note="rows of the top-ops table")
    # None: self_cuda_time_total on CUDA, else self_cpu_time_total
    sort_by: Optional[str] = plugin_option(None, choices=SORT_KEYS, note="or null")

    def __post_init__(self) -> None:
        check_plugin_options(self)


class Profiler(Callback):
    """torch.profiler over chosen steps: a Chrome/Perfetto trace and a top-ops table."""

    name = "profiler"
    run_files = (FOLDER,)
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
        else:
            # Kineto looks for GPUs even when asked for CPU activity only, and logs an
            # ERROR line ("gpuGetDeviceCount failed") on a machine without one; 5 keeps
            # its messages below the level that prints. Read at its first use.
            os.environ.setdefault("KINETO_LOG_LEVEL", "5")
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
