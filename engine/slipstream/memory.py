"""Peak memory of a run: what a training run adds on top of what was already there.

On CUDA, ``torch.cuda.max_memory_allocated`` after a reset at the start. On CPU, the
growth of the resident set: on Linux the kernel's high-water mark (``VmHWM``) is
reset at the start through ``/proc/self/clear_refs``, so the figure is this run's
alone even after earlier runs in the same process (a benchmark running recipes one
after another). Elsewhere the process's lifetime peak (``ru_maxrss``) stands in,
which is exact for the first run in a process and a lower bound after it.
"""

from __future__ import annotations

import ctypes
import gc
import sys

import torch

__all__ = ["PeakMemory"]

MIB = 2**20


class PeakMemory:
    """``start()`` at the start of training, ``peak_mb()`` at any time after."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._start_bytes: int | None = None

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        # Free what earlier work left for the collector and the allocator first: were it
        # freed during the run instead, the run's own growth would hide under it.
        gc.collect()
        _trim_malloc()
        _reset_high_water_mark()
        self._start_bytes = _resident_bytes()

    def peak_mb(self) -> float | None:
        """Peak MiB allocated (CUDA) or added to the resident set (CPU) since
        ``start()``; None before it."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / MIB
        peak = _high_water_bytes()
        if self._start_bytes is None or peak is None:
            return None
        return max(peak - self._start_bytes, 0) / MIB


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _resident_bytes() -> int | None:
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else _max_rss_bytes()


def _high_water_bytes() -> int | None:
    kib = _status_kib("VmHWM")
    return kib * 1024 if kib is not None else _max_rss_bytes()


def _trim_malloc() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc: give freed heap pages back
    except (OSError, AttributeError):
        pass  # another C library: nothing to do


def _reset_high_water_mark() -> None:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # 5: reset the peak resident set size (Linux 4.0+)
    except OSError:
        pass  # not Linux, or not allowed: the lifetime peak stands in


def _max_rss_bytes() -> int | None:
    try:
        import resource
    except ImportError:  # Windows: unknown
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere
