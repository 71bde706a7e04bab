"""Optimizer step time by implementation (for-loop, foreach, fused) on ResNet-18's
parameters, interleaved in one process. Backs the engine's default `impl: auto`.

    .venv/bin/python benchmarks/bench_optimizer_impl.py [--threads 2]
"""

from __future__ import annotations

import statistics
import time

import timm
import torch

from slipstream.optim import build_optimizer

try:
    from common import parser
except ImportError:  # run from the repository root
    from benchmarks.common import parser


def main() -> None:
    args = parser(__doc__).parse_args()
    torch.set_num_threads(args.threads)
    model = timm.create_model("resnet18", num_classes=10)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    impls = ("for_loop", "foreach", "fused")
    repeats = 1 if args.quick else args.repeats
    steps = 3 if args.quick else args.steps
    for name in ("sgd", "adamw"):
        optimizers = {impl: build_optimizer(model, name, 1e-3, impl=impl) for impl in impls}
        times: dict[str, list[float]] = {impl: [] for impl in impls}
        for _ in range(repeats):
            for impl, opt in optimizers.items():
                opt.step()  # warm-up: creates state
                start = time.perf_counter()
                for _ in range(steps):
                    opt.step()
                times[impl].append((time.perf_counter() - start) / steps)
        base = statistics.median(times["for_loop"])
        print(
            f"{name}: "
            + ", ".join(
                f"{impl} {1000 * statistics.median(t):.1f} ms ({base / statistics.median(t):.2f}x)"
                for impl, t in times.items()
            )
        )


if __name__ == "__main__":
    main()
