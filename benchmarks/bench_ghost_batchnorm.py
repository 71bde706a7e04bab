"""ghost_batchnorm: what normalising ghost batches costs per training step.

A hand-written loop (forward, cross-entropy, backward, SGD step) on random data, one
thread, plain batch norm against ghost batch norm at two ghost sizes, variants
interleaved step by step in one process; the plugin's functional API makes the ghost
models, as its ``init`` does. CPU time per step (steadier than wall time on a shared
machine), median over steps, and the ratio to plain.

    .venv/bin/python benchmarks/bench_ghost_batchnorm.py            # ~2 min on 2 cores
    .venv/bin/python benchmarks/bench_ghost_batchnorm.py --steps 5 --warmup 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import timm
import torch
import torch.nn.functional as F
import torchvision
from slipstream_ghost_batchnorm import apply_ghost_batchnorm, ghost_chunks

MODELS = {
    "timm test_resnet, 32 px, batch 128": (lambda: timm.create_model("test_resnet", num_classes=10), 32, 128),
    "torchvision resnet18, 32 px, batch 64": (lambda: torchvision.models.resnet18(num_classes=10), 32, 64),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ghost-sizes", type=int, nargs="+", default=[32, 8])
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, fp32, {args.steps} steps per variant (median CPU time)")
    for label, (build, size, batch) in MODELS.items():
        loops = {}
        for ghost in (None, *args.ghost_sizes):
            torch.manual_seed(0)
            model = build().train()
            if ghost is not None:
                apply_ghost_batchnorm(model, ghost)
            name = "plain" if ghost is None else f"ghost {ghost} ({ghost_chunks(batch, ghost)} chunks)"
            loops[name] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        x = torch.rand(batch, 3, size, size)
        y = torch.randint(0, 10, (batch,))
        times: dict[str, list[float]] = {v: [] for v in loops}
        for step in range(args.warmup + args.steps):
            for name, (model, opt) in loops.items():
                start = time.process_time()
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if step >= args.warmup:
                    times[name].append(time.process_time() - start)
        base = statistics.median(times["plain"])
        print(f"{label}:")
        for name, measured in times.items():
            t = statistics.median(measured)
            print(f"  {name:<22} {1e3 * t:8.1f} ms  {t / base:.3f}x")


if __name__ == "__main__":
    main()
