"""label_smoothing: what the smoothed loss costs per step (it should cost nothing).

(a) The loss alone: forward + backward of plain vs label-smoothed cross-entropy on
    (batch, classes) logits, microseconds per call.
(b) End to end through the real Trainer: a model at 32 px with and without the plugin.

    .venv/bin/python benchmarks/bench_label_smoothing.py            # ~1 min
    .venv/bin/python benchmarks/bench_label_smoothing.py --quick
"""

from __future__ import annotations

import statistics
import time

import timm
import torch
import torch.nn.functional as F
from slipstream_label_smoothing import LabelSmoothing, LabelSmoothingConfig, smooth_cross_entropy

from common import compare, parser, random_loader, report
from slipstream import Algorithm, hookimpl


def loss_alone(batch: int, classes: int, calls: int, repeats: int) -> None:
    logits = torch.randn(batch, classes, requires_grad=True)
    targets = torch.randint(0, classes, (batch,))
    fns = {
        "plain cross-entropy": lambda: F.cross_entropy(logits, targets),
        "smooth_cross_entropy 0.1": lambda: smooth_cross_entropy(logits, targets, 0.1),
    }
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.process_time()  # CPU time: steadier than wall time on a shared machine
            for _ in range(calls):
                fn().backward()
            times[name].append((time.process_time() - start) / calls)
    base = statistics.median(times["plain cross-entropy"])
    print(f"(a) loss forward+backward on ({batch}, {classes}) logits, CPU time per call")
    for name, t in times.items():
        med = statistics.median(t)
        print(f"{name:<28} {1e6 * med:>8.1f} us {med / base:>8.2f}x")


class CpuTimer(Algorithm):
    """Process CPU time at the end of every batch."""

    name = "bench_cpu_timer"

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    @hookimpl
    def batch_end(self, state) -> None:
        self.times.append(time.process_time())


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch-size", type=int, default=64)
    p.set_defaults(steps=8, warmup=2, repeats=3)
    args = p.parse_args()
    if args.quick:
        args.model, args.batch_size, args.steps, args.warmup, args.repeats = (
            "test_resnet",
            16,
            2,
            1,
            1,
        )
    torch.set_num_threads(args.threads)
    loss_alone(args.batch_size, 10, 50 if args.quick else 500, args.repeats)

    timers: dict[str, list[CpuTimer]] = {}

    def build(name, algorithms):
        def variant():
            torch.manual_seed(0)
            model = timm.create_model(args.model, num_classes=10)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            timers.setdefault(name, []).append(CpuTimer())
            return model, opt, [*algorithms(), timers[name][-1]]

        return variant

    variants = {
        "plain cross-entropy": build("plain cross-entropy", list),
        "label_smoothing 0.1": build(
            "label_smoothing 0.1", lambda: [LabelSmoothing(LabelSmoothingConfig(0.1))]
        ),
    }
    data = random_loader(args.batch_size * (args.warmup + args.steps), 32, args.batch_size)
    results = compare(variants, data, steps=args.steps, warmup=args.warmup, repeats=args.repeats)
    report(f"(b) {args.model} at 32 px, batch {args.batch_size}, step time", results)
    w = args.warmup
    cpu = {
        name: statistics.median((t.times[-1] - t.times[w - 1]) / (len(t.times) - w) for t in ts)
        for name, ts in timers.items()
    }
    base = cpu["plain cross-entropy"]
    print("CPU time per step (steadier than wall time on a shared machine)")
    for name, c in cpu.items():
        print(f"{name:<28} {1000 * c:>9.1f} {base / c:>8.2f}x")


if __name__ == "__main__":
    main()
