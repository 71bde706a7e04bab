"""Peak memory of a run: what a training run adds on top of what was already there.

On CUDA, ``torch.cuda.max_memory_allocated`` after a reset at the start. On CPU, the
growth of the resident set: on Linux the kernel's high-water mark (``VmHWM``) is
reset at the start through ``/proc/self/clear_refs``, so the figure is this run's
alone even after earlier runs in the same process (a benchmark running recipes one
after another). Elsewhere the process's lifetime peak (``ru_maxrss``) stands in,
which is exact for the first run in a process and a lower bound after it.

What the process held before the run must not be released during it, or the run's own
growth would hide under what was freed. Collecting it all first (``gc.collect()``) cost
0.2 s a run here, a quarter of a small run's ``fit()``, since it visits every object
torch and the plugins keep alive. Instead the young generations are collected (cheap)
and everything older is frozen for the run (``gc.freeze``, which moves the collector's
lists in constant time): the collector cannot free it during the run, so the baseline
holds, and ``stop()`` hands it back at the end, when the next collection frees what of
it is garbage. The price is that garbage an earlier run left in cycles lives until this
run ends instead of being freed before it. The freeze also keeps the run's own garbage
collections from walking everything torch keeps alive: with the young collection but
no freeze, whole runs of the peers' tiny MLP measured 1.23x a hand-written loop, against
1.11x with it (``benchmarks/bench_overhead.py --run-parts``, 2026-11-27).
"""

from __future__ import annotations

import ctypes
import gc
import sys

import torch

__all__ = ["PeakMemory"]

MIB = 2**20


class PeakMemory:
    """``start()`` at the start of training, ``stop()`` at its end (also on failure),
    ``peak_mb()`` at any time after ``start()``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._start_bytes: int | None = None
        self._frozen = False

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        if gc.get_freeze_count() == 0:
            gc.collect(1)
            gc.freeze()
            self._frozen = True
        else:  # someone else froze objects: unfreezing at the end would thaw theirs too
            gc.collect()
        _trim_malloc()
        _reset_high_water_mark()
        self._start_bytes = _resident_bytes()

    def stop(self) -> None:
        """End of the run: the objects frozen at ``start()`` go back to the collector.
        Idempotent; the peak stays readable."""
        if self._frozen:
            self._frozen = False
            gc.unfreeze()

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
