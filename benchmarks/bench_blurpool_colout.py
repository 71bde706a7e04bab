"""Cost per training step of blurpool and colout against the plain step (issue 42).

A hand-written step (forward, cross-entropy, backward, SGD step) of a timm ResNet on
random data, fp32, one thread; the variants are interleaved (A B C A B C ...) and each
reports the median of its repetitions, so that load from other processes on a shared
machine hits them alike. ColOut's time includes dropping the rows and columns.

    .venv/bin/python benchmarks/bench_blurpool_colout.py [--model resnet18] [--size 64] [--batch 16]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import timm
import torch
import torch.nn.functional as F
from slipstream_blurpool import apply_blurpool
from slipstream_colout import colout_batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per repetition")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = timm.create_model(args.model, num_classes=10)
    blurred = copy.deepcopy(base)
    replaced = apply_blurpool(blurred)
    x = torch.rand(args.batch, 3, args.size, args.size)
    y = torch.randint(0, 10, (args.batch,))
    g = torch.Generator()

    def make(model, transform):
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step(i: int) -> None:
            inputs = transform(x, i)
            loss = F.cross_entropy(model(inputs), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    variants = {
        "plain": make(copy.deepcopy(base), lambda t, i: t),
        f"blurpool ({replaced} layers)": make(blurred, lambda t, i: t),
        "colout (0.15, 0.15, batch)": make(
            copy.deepcopy(base), lambda t, i: colout_batch(t, 0.15, 0.15, g.manual_seed(i))
        ),
        "colout per image": make(
            copy.deepcopy(base), lambda t, i: colout_batch(t, 0.15, 0.15, g.manual_seed(i), batch=False)
        ),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for step in variants.values():  # warm-up
        step(0)
    for r in range(args.repeats):
        for name, step in variants.items():
            t = time.perf_counter()
            for i in range(args.steps):
                step(r * args.steps + i)
            times[name].append((time.perf_counter() - t) / args.steps)
    plain = statistics.median(times["plain"])
    print(f"{args.model}, {args.size} px, batch {args.batch}, fp32, 1 thread, "
          f"median of {args.repeats}x{args.steps} steps")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:28s} {med * 1e3:8.1f} ms/step  {med / plain:5.2f}x the plain step's time")


if __name__ == "__main__":
    main()
