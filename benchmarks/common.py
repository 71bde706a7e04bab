"""Side-by-side measurements for the benchmark scripts.

Every benchmark compares a baseline with a treatment *in one process*, interleaving
repetitions (A B A B ...) so that a noisy, shared machine slows both alike, and
reports ratios rather than absolute times.

Time is measured through the real engine (``slipstream.Trainer``) with the real
plugins; memory is the peak resident-set growth during training, sampled at about
1 kHz, after returning freed memory to the OS between variants (CPU has no
allocator statistics like ``torch.cuda.max_memory_allocated``; on CUDA we use those).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Algorithm, Trainer, hookimpl
from slipstream.plugins.discovery import discover, plugin_config


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--steps", type=int, default=20, help="timed training steps per repetition")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before timing")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repetitions per variant")
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes, one repetition")
    return p


def image_folder_args(description: str) -> argparse.Namespace:
    """The options of the benchmarks that write an ImageFolder of JPEGs and read it
    back (bench_data, bench_imagefolder), parsed; threads set, torchvision's decoder
    deprecation silenced."""
    p = parser(description)
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers, both sides")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--size", type=int, default=64, help="output side length (px)")
    p.add_argument("--source", type=int, nargs=2, default=[320, 240], help="written W H")
    p.add_argument("--per-class", type=int, default=100)
    args = p.parse_args()
    if args.quick:
        args.per_class, args.repeats = 16, 1
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*TorchVision are deprecated.*")
    return args


def random_loader(n: int, image_size: int, batch_size: int, num_classes: int = 10) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 3, image_size, image_size, generator=g)
    y = torch.randint(0, num_classes, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False, drop_last=True)


def per_step(times: list[float], warmup: int) -> float:
    """Seconds per step from clock readings at the end of each step, the first
    ``warmup`` steps left out (with none, the first reading is the start)."""
    if warmup > 0:
        return (times[-1] - times[warmup - 1]) / (len(times) - warmup)
    return (times[-1] - times[0]) / (len(times) - 1)


class StepClock(Algorithm):
    """Reads ``clock`` at the end of every batch: host wall time by default, or e.g.
    ``time.process_time`` for the process's CPU time. On CUDA it synchronises first,
    so a reading is the end of that batch's device work."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, name: str = "bench_timer") -> None:
        super().__init__()
        self.name = name  # two clocks in one run need two plugin names
        self.clock = clock
        self.times: list[float] = []
        self._sync = False

    @hookimpl
    def fit_start(self, state: Any) -> None:
        # Decided once: reading device.type costs microseconds between small steps,
        # which the hand-written loop it is compared with does not pay.
        self._sync = state.device.type == "cuda"

    @hookimpl
    def batch_end(self, state: Any) -> None:
        if self._sync:
            torch.cuda.synchronize()
        self.times.append(self.clock())


class PeakRSS:
    """Peak growth of the resident set size inside the ``with`` block, in MiB."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.peak_mib = 0.0

    @staticmethod
    def rss_mib() -> float:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * 4096 / 2**20

    def __enter__(self) -> PeakRSS:
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed memory back first
        except OSError:
            pass
        self._start = self.rss_mib()
        self._peak = self._start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self.rss_mib())
            time.sleep(self.interval_s)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self.rss_mib())
        self.peak_mib = self._peak - self._start


@dataclass
class Result:
    name: str
    step_s: list[float] = field(default_factory=list)
    peak_mib: list[float] = field(default_factory=list)

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def median_peak_mib(self) -> float:
        return statistics.median(self.peak_mib) if self.peak_mib else float("nan")


Variant = Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer, list[Algorithm]]]


def run_variant(
    build: Variant,
    loader: DataLoader,
    steps: int,
    warmup: int,
    measure_memory: bool = False,
    device: str = "cpu",
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, float]:
    """(seconds per step, peak MiB) for one training run of warmup + steps batches,
    read on ``clock`` (``time.process_time``: CPU time, which a shared machine's
    descheduling does not add to)."""
    model, optimizer, algorithms = build()
    timer = StepClock(clock)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(
            model=model,
            optimizer=optimizer,
            train_data=loader,
            max_duration=f"{warmup + steps}ba",
            algorithms=[*algorithms, timer],
            run_dir=Path(tmp) / "run",
            device=device,
            eval_interval=None,
            checkpoint_interval=None,
            progress_bar=False,
            verbose=False,
            log_interval=10**9,
        )
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        if measure_memory and device != "cuda":
            with PeakRSS() as mem:
                trainer.fit()
            peak = mem.peak_mib
        else:
            trainer.fit()
            peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else float("nan")
    return per_step(timer.times, warmup), peak


def compare(
    variants: dict[str, Variant],
    loader: DataLoader | Callable[[str], DataLoader],
    *,
    steps: int,
    warmup: int,
    repeats: int,
    measure_memory: bool = False,
    device: str = "cpu",
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Result]:
    """Run every variant ``repeats`` times, interleaved; the first is the baseline."""
    results = {name: Result(name) for name in variants}
    for _ in range(repeats):
        for name, build in variants.items():
            data = (
                loader(name) if callable(loader) and not isinstance(loader, DataLoader) else loader
            )
            step_s, peak = run_variant(build, data, steps, warmup, measure_memory, device, clock)
            results[name].step_s.append(step_s)
            results[name].peak_mib.append(peak)
    return results


def report(title: str, results: dict[str, Result], memory: bool = False) -> str:
    """A table with speed-up (and memory) ratios against the first variant."""
    names = list(results)
    base = results[names[0]]
    lines = [
        title,
        f"{'variant':<28} {'ms/step':>9} {'speed-up':>9}"
        + (f" {'peak MiB':>9} {'memory':>8}" if memory else ""),
    ]
    for name in names:
        r = results[name]
        line = f"{name:<28} {1000 * r.median_step_s:>9.1f} {base.median_step_s / r.median_step_s:>8.2f}x"
        if memory:
            line += f" {r.median_peak_mib:>9.1f} {r.median_peak_mib / base.median_peak_mib:>7.2f}x"
        lines.append(line)
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def mixed_precision_bf16() -> Callable[[], Algorithm] | None:
    """A builder of the mixed_precision plugin in bf16, or None if it is not installed."""
    info = discover().get("mixed_precision")
    if info is None or info.cls is None:
        print("(mixed_precision is not installed: bf16 variants skipped)")
        return None
    return lambda: info.cls(plugin_config(info.cls, {"dtype": "bf16"}))


# -- step benchmarks: one model, SGD, with and without a plugin -----------------------


def step_args(description: str, quick_warmup: int = 1) -> argparse.Namespace:
    """A step benchmark's options (10 timed steps after 2, 3 repetitions; ``--quick``:
    3 after ``quick_warmup``, once), parsed, with torch's threads set."""
    p = parser(description)
    p.set_defaults(steps=10, warmup=2, repeats=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.steps, args.warmup, args.repeats = 3, quick_warmup, 1
    return args


def sgd_variant(
    model_name: str, size: int, make: Callable[[], list[Algorithm]] | None = None, **model_kwargs: Any
) -> Variant:
    """``model_name`` for 10 classes at ``size`` px, built seeded (every variant starts
    from the same weights), SGD (lr 0.05, momentum 0.9), and the algorithms ``make()``
    returns (None: the plain baseline)."""
    from slipstream.models import build_model

    def build():
        torch.manual_seed(0)
        model = build_model(model_name, 10, image_size=size, **model_kwargs)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return model, optimizer, make() if make is not None else []

    return build


def time_variants(
    variants: dict[str, Variant],
    args: argparse.Namespace,
    *,
    size: int,
    batch: int,
    title: str,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Result]:
    """:func:`compare` on random ``size`` px batches of ``batch``, as ``args`` says, and
    the table under ``title``."""
    data = random_loader(batch * (args.warmup + args.steps), size, batch)
    results = compare(variants, data, steps=args.steps, warmup=args.warmup, repeats=args.repeats, clock=clock)
    report(title, results)
    return results
