"""What precision and memory format give a compute-bound training step on this machine,
in a hand-written loop (no engine) and through ``slipstream.Trainer``, in one process.

The network is the CIFAR-stem ResNet-18 (3x3 stride-1 stem, no max-pool) at the reference
recipes' width (16-32-64-128 channels, ``--width 16``) or at full width (``--width 64``).
Variants: fp32 NCHW (the baseline), fp32 channels-last, bf16 autocast, bf16 autocast +
channels-last; each also at the smaller ``--sizes`` (what an image-size curriculum would
save). The loop is the plainest one: AdamW, cross-entropy, random data already on the
device. Reported per variant: median process CPU time and wall time per step over
interleaved repetitions, the speed-up on each against fp32 NCHW at the first size, and
MFU against the peak of the dtype the variant computes in (the engine's matmul probe,
cached per machine). Before concluding that a CPU "caps" a technique, read this table:
if the plain loop gains and the engine does not, the engine is at fault; if neither
gains, the hardware lacks the units (bf16 on an AVX2-only CPU is emulated).

    .venv/bin/python benchmarks/bench_plain_loop.py                      # ~3 min idle
    .venv/bin/python benchmarks/bench_plain_loop.py --width 64 --batch 32 --sizes 32 24 16
    .venv/bin/python benchmarks/bench_plain_loop.py --engine             # the Trainer beside it
    .venv/bin/python benchmarks/bench_plain_loop.py --quick
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from slipstream_channels_last import ChannelsLast

from common import compare, mixed_precision_bf16, parser
from slipstream import Algorithm
from slipstream.models import build_model
from slipstream.services.flops import training_flops_per_sample
from slipstream.services.peak_flops import peak_flops, peak_name

VARIANTS = {  # name: (channels_last, bf16)
    "fp32": (False, False),
    "fp32 + channels_last": (True, False),
    "bf16": (False, True),
    "bf16 + channels_last": (True, True),
}


def network(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    channels = [width, 2 * width, 4 * width, 8 * width]
    return build_model("resnet18", 10, cifar_stem=True, channels=channels, stem_width=width)


def loop_step_times(
    width: int, size: int, batch: int, cl: bool, bf16: bool, steps: int, warmup: int, device: str = "cpu"
):
    """(CPU seconds, wall seconds) per step, medians, of a hand-written training loop.
    On CUDA each step ends with a synchronisation, so its wall time is the device's."""
    model = network(width)
    fmt = torch.channels_last if cl else torch.contiguous_format
    model = model.to(device=device, memory_format=fmt)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=fmt)
    targets = torch.randint(0, 10, (batch,), device=device)
    autocast = torch.autocast(device, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    cpu, wall = [], []
    for i in range(warmup + steps):
        sync()
        c0, w0 = time.process_time(), time.perf_counter()
        with autocast:
            loss = F.cross_entropy(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        sync()
        if i >= warmup:
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), statistics.median(wall)


class DeviceBatches:
    """The loop's one batch, already on the device, ``steps`` times: the Trainer gets
    its data as the hand-written loop does, so neither side's time holds a
    DataLoader's collation or a host-to-device copy, and the difference is the engine."""

    def __init__(self, batch: int, size: int, steps: int, device: torch.device) -> None:
        self.batch_size = batch
        self.steps = steps
        self.inputs = torch.randn(batch, 3, size, size, device=device)
        self.targets = torch.randint(0, 10, (batch,), device=device)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        return iter([(self.inputs, self.targets)] * self.steps)


def engine_variant(width: int, cl: bool, bf16: Callable[[], Algorithm] | None):
    def build():
        model = network(width)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        algorithms = ([ChannelsLast()] if cl else []) + ([bf16()] if bf16 else [])
        return model, optimizer, algorithms

    return build



def main() -> None:
    p = parser(__doc__)
    p.add_argument("--width", type=int, default=16, help="stem width: 16 (the reference recipes) or 64 (full)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--sizes", type=int, nargs="+", default=[32], help="input sizes in px (the first is the baseline's)")
    p.add_argument("--engine", action="store_true", help="also time each variant at the first size through the Trainer")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: the GPU check's comparison")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False on this machine")
    if args.quick:
        args.width, args.sizes, args.steps, args.warmup, args.repeats = 8, [16], 3, 1, 1
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    peak = peak_flops(device, threads=args.threads)
    # fp32 on CUDA runs its convolutions on TF32 tensor cores (cuDNN's default).
    fp32_peak = peak_name(torch.float32, device, network(args.width))
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{args.threads} threads"
    print(
        f"CIFAR-stem ResNet-18, width {args.width}, batch {args.batch}, {where}, "
        f"peak ({peak.source}): " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in peak.flops.items()),
        flush=True,
    )
    flops = {
        s: training_flops_per_sample(network(args.width), torch.empty(1, 3, s, s)) for s in args.sizes
    }
    cases = [(name, size) for size in args.sizes for name in VARIANTS]
    cpu: dict[Any, list[float]] = {c: [] for c in cases}
    wall: dict[Any, list[float]] = {c: [] for c in cases}
    for _ in range(args.repeats):  # interleaved, so a noisy machine slows every variant alike
        for name, size in cases:
            cl, bf16 = VARIANTS[name]
            c, w = loop_step_times(args.width, size, args.batch, cl, bf16, args.steps, args.warmup, args.device)
            cpu[name, size].append(c)
            wall[name, size].append(w)
    base = cases[0]
    b_cpu, b_wall = statistics.median(cpu[base]), statistics.median(wall[base])
    print(f"\nhand-written loop ({flops[args.sizes[0]] / 1e9:.3f} GFLOP per training image at {args.sizes[0]} px)")
    print(f"{'variant':<24} {'px':>4} {'CPU ms':>8} {'speed-up':>9} {'wall ms':>8} {'speed-up':>9} {'MFU':>6}")
    for name, size in cases:
        c, w = statistics.median(cpu[name, size]), statistics.median(wall[name, size])
        dtype = "bf16" if VARIANTS[name][1] else fp32_peak
        mfu = flops[size] * args.batch / w / peak.flops[dtype]
        print(
            f"{name:<24} {size:>4} {1e3 * c:>8.1f} {b_cpu / c:>8.2f}x {1e3 * w:>8.1f} {b_wall / w:>8.2f}x "
            f"{100 * mfu:>5.1f}%"
        )
    if args.engine:
        bf16 = mixed_precision_bf16()
        variants = {
            name: engine_variant(args.width, cl, bf16 if use_bf16 else None)
            for name, (cl, use_bf16) in VARIANTS.items()
            if bf16 is not None or not use_bf16
        }
        size = args.sizes[0]
        data = DeviceBatches(args.batch, size, args.warmup + args.steps, device)
        results = compare(
            variants, data, steps=args.steps, warmup=args.warmup, repeats=args.repeats, device=args.device
        )
        engine_base = results["fp32"].median_step_s
        print(f"\nthrough slipstream.Trainer at {size} px (wall time; gain against the loop's gain)")
        print(f"{'variant':<24} {'wall ms':>8} {'speed-up':>9} {'of loop':>8}")
        for name, r in results.items():
            gain = engine_base / r.median_step_s
            loop_gain = b_wall / statistics.median(wall[name, size])
            print(f"{name:<24} {1e3 * r.median_step_s:>8.1f} {gain:>8.2f}x {gain / loop_gain:>7.2f}")


if __name__ == "__main__":
    main()
