"""The device's peak FLOP/s per dtype: the denominator of MFU.

Measured with a short matmul probe (the best rate of a few square matmuls, sized up
until one takes long enough to time) and cached per machine in
``$XDG_CACHE_HOME/slipstream/peak_flops.json`` (``~/.cache`` without it), keyed by
device, thread count and torch version, so a machine pays for the probe once.
``trainer.peak_tflops`` skips the probe: a number for every dtype, or one per dtype.

On CUDA, fp32 tensors may be computed on TF32 tensor cores, about 8x the rate of
true fp32 on an H100: cuDNN convolutions do by default (``cudnn.allow_tf32``), and
matmuls where ``torch.set_float32_matmul_precision`` allows it. So a CUDA device has
a ``tf32`` peak beside ``fp32``; :func:`peak_name` says which one a run is measured
against (against true fp32, a ResNet in fp32 showed 120 % MFU on an H100).
"""

from __future__ import annotations

import json
import os
import platform
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from slipstream.config.options import DTYPES, parse_peak_tflops

__all__ = [
    "DTYPES",
    "Peak",
    "cache_path",
    "dtype_name",
    "machine_key",
    "measure_matmul_flops",
    "parse_peak_tflops",
    "peak_name",
    "peak_flops",
    "probe_dtypes",
]

CACHE_FILE = Path("slipstream") / "peak_flops.json"
PROBE_SECONDS = 0.25  # per dtype, after sizing up
MIN_MATMUL_SECONDS = 0.02  # one matmul at least this long, so the clock resolves it
MAX_SIZE = {"cpu": 2048, "cuda": 8192}


@dataclass
class Peak:
    """Peak FLOP/s per dtype name and where the figures came from."""

    flops: dict[str, float]
    source: str  # probe | cache | config

    def tflops(self) -> dict[str, float]:
        return {name: round(value / 1e12, 6) for name, value in self.flops.items()}


def dtype_name(dtype: torch.dtype | None) -> str:
    """``"fp32"``, ``"bf16"`` or ``"fp16"`` for a compute dtype (None: fp32)."""
    if dtype is None:
        return "fp32"
    for name, candidate in DTYPES.items():
        if dtype == candidate:
            return name
    return str(dtype).removeprefix("torch.")


def probe_dtypes(device: torch.device) -> list[str]:
    """The peaks a run on ``device`` may be measured against: fp32 and bf16 (where
    the device has it); on CUDA also tf32 and fp16 (fp16 on CPU is emulated: not a peak)."""
    if device.type == "cuda":
        names = ["fp32", "tf32", "fp16"]
        if torch.cuda.is_bf16_supported():
            names.insert(2, "bf16")
        return names
    return ["fp32", "bf16"]


def peak_name(compute_dtype: torch.dtype | None, device: torch.device, model: torch.nn.Module) -> str:
    """The peak a run computing in ``compute_dtype`` on ``device`` is measured
    against: the dtype's own, except fp32 on CUDA where the bulk of the model's
    math runs on TF32 tensor cores: matmuls when torch's fp32 matmul precision
    allows TF32; convolutions when cuDNN allows it and the model's convolution
    weights outnumber its linear ones (a ResNet, not a ViT with a conv patch stem)."""
    name = dtype_name(compute_dtype)
    if name != "fp32" or device.type != "cuda":
        return name
    if torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    if torch.backends.cudnn.enabled and torch.backends.cudnn.allow_tf32:
        if _weights(model, torch.nn.modules.conv._ConvNd) > _weights(model, torch.nn.Linear):
            return "tf32"
    return "fp32"


def _weights(model: torch.nn.Module, kind: type) -> int:
    """How many weights the ``kind`` layers of ``model`` hold (lazy layers not yet
    built count none)."""
    total = 0
    for module in model.modules():
        weight = getattr(module, "weight", None) if isinstance(module, kind) else None
        if isinstance(weight, torch.Tensor) and not isinstance(weight, torch.nn.parameter.UninitializedParameter):
            total += weight.numel()
    return total


@contextmanager
def _fp32_matmuls_on_tf32(device: torch.device, allowed: bool) -> Iterator[None]:
    """CUDA fp32 matmuls on TF32 tensor cores (``allowed``) or in true fp32."""
    if device.type != "cuda":
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allowed
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _probe(device: torch.device, name: str) -> float:
    with _fp32_matmuls_on_tf32(device, name == "tf32"):
        return measure_matmul_flops(device, DTYPES.get(name, torch.float32))


def cache_path(name: str = CACHE_FILE) -> Path:
    """``$XDG_CACHE_HOME/<name>`` (``~/.cache`` without it): where the engine keeps
    what it measured once per machine (``name``: this cache's file by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / name


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def machine_key(device: torch.device, threads: int | None = None) -> str:
    """The cache key: the device (GPU name or CPU model), the threads a CPU run uses
    and the torch version. (The fp32 and tf32 peaks are probed apart, whatever the
    run's fp32 matmul precision.)"""
    parts = [device.type, device_label(device)]
    if device.type != "cuda":
        parts.append(f"threads={threads or torch.get_num_threads()}")
    parts.append(f"torch={torch.__version__}")
    return " | ".join(parts)


def measure_matmul_flops(
    device: torch.device, dtype: torch.dtype, seconds: float = PROBE_SECONDS
) -> float:
    """The best FLOP/s of square matmuls on ``device`` in ``dtype``.

    The size doubles from 256 until one matmul takes ``MIN_MATMUL_SECONDS`` (or the
    device's cap), so a dtype the hardware only emulates costs a fraction of a second
    instead of minutes. Inputs come from a private generator: the run's random
    streams are untouched.
    """
    generator = torch.Generator(device=device).manual_seed(0)

    def operands(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.randn(n, n, device=device, generator=generator).to(dtype)
        b = torch.randn(n, n, device=device, generator=generator).to(dtype)
        return a, b

    n = 256
    a, b = operands(n)
    _timed_matmul(a, b, device)  # first call: kernel selection, library start-up
    while True:
        took = _timed_matmul(a, b, device)
        if took >= MIN_MATMUL_SECONDS or n >= MAX_SIZE.get(device.type, 2048):
            break
        n *= 2
        a, b = operands(n)
        _timed_matmul(a, b, device)
    best = took
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        best = min(best, _timed_matmul(a, b, device))
    return 2 * n**3 / best


def _timed_matmul(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    started = time.perf_counter()
    torch.mm(a, b)
    return time.perf_counter() - started


def peak_flops(
    device: torch.device,
    configured: dict[str, float] | None = None,
    *,
    threads: int | None = None,
    path: Path | None = None,
    on_probe: Callable[[], None] | None = None,
) -> Peak:
    """The peak FLOP/s of ``device`` per dtype: ``configured`` (from
    :func:`parse_peak_tflops`) when given, else the cache, else a fresh probe that is
    then cached. A cache that cannot be read or written costs only a probe.
    ``on_probe`` is called just before a probe (not when the cache answers)."""
    names = probe_dtypes(device)
    if configured is not None:
        every = configured.get("*")
        flops = {n: every for n in names} if every is not None else {}
        flops.update({n: v for n, v in configured.items() if n != "*"})
        return Peak(flops, "config")
    path = path or cache_path()
    key = machine_key(device, threads)
    cache = read_cache(path)
    cached = cache.get(key, {}).get("flops", {})
    if all(isinstance(cached.get(n), (int, float)) and cached[n] > 0 for n in names):
        return Peak(_at_least_fp32({n: float(cached[n]) for n in names}), "cache")
    if on_probe is not None:
        on_probe()
    flops = {n: _probe(device, n) for n in names}
    cache[key] = {
        "flops": flops,  # as measured
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    write_cache(
        path, cache, "the peak FLOP/s", "the next run probes again (set XDG_CACHE_HOME or trainer.peak_tflops)"
    )
    return Peak(_at_least_fp32(flops), "probe")


def raise_peak(
    device: torch.device,
    peak: Peak,
    *,
    threads: int | None = None,
    path: Path | None = None,
) -> Peak:
    """A run did more FLOP/s than ``peak`` says the device can (MFU above 1): the
    peak was probed on a busy machine. Probe again and keep, per dtype, the larger of
    the old figure and the new probe, in the cache too, so the next run starts right.
    The run's own rate is never taken as a peak: the clock of a run of a few batches
    (or one whose FLOPs were miscounted) says nothing about the device, and one such
    figure in the cache would shrink every later run's MFU."""
    names = probe_dtypes(device)
    fresh = {n: _probe(device, n) for n in names}
    flops = {n: max(peak.flops.get(n, 0.0), fresh[n]) for n in names}
    path = path or cache_path()
    cache = read_cache(path)
    cache[machine_key(device, threads)] = {
        "flops": flops,
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "raised_by_a_run": True,
    }
    write_cache(
        path, cache, "the peak FLOP/s", "the next run probes again (set XDG_CACHE_HOME or trainer.peak_tflops)"
    )
    return Peak(_at_least_fp32(flops), f"{peak.source}, raised")


def _at_least_fp32(flops: dict[str, float]) -> dict[str, float]:
    """No dtype's peak below fp32's. A device without native bf16 (a CPU without
    AVX-512 BF16 or AMX) runs bf16 matmuls on a slow path, but its convolution
    kernels compute bf16 in fp32 at the fp32 rate: the slow probe is not the peak,
    and MFU against it would exceed 1."""
    floor = flops.get("fp32", 0.0)
    return {name: max(value, floor) for name, value in flops.items()}


def read_cache(path: Path) -> dict[str, Any]:
    """A per-machine JSON cache (peak FLOP/s, measured auto variants); ``{}`` when it is
    absent or corrupt, so the caller measures again and rewrites it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_cache(path: Path, cache: dict[str, Any], what: str, otherwise: str) -> None:
    """Write ``cache`` to ``path`` atomically (two runs starting together never leave
    half a file); a failure is a warning naming ``what`` was not cached and what
    happens ``otherwise``, never an error: the run goes on."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=2) + "\n", encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        warnings.warn(f"slipstream: cannot cache {what} in {path} ({exc.strerror}); {otherwise}", stacklevel=3)
