"""Engine overhead on the peers' tiny-MLP workload: a small MLP on random data, many
small steps, where anything the engine adds per batch shows. Side by side in one
process, repetitions interleaved; the hand-written loop is 1.00.

    hand-written loop      for x, y in loader: loss = ...; backward; step; zero_grad
    Trainer bare           no progress bar, no evaluation, no checkpoints
    Trainer + progress bar the same with the tqdm bar drawing (to /dev/null)
    Trainer, no services   (--breakdown) bare without the engine's per-batch services:
                           what is left is the loop itself (hooks, batch move, counters)

The Trainer runs as users get it otherwise: metrics at the default interval (one
device sync each), MFU counting, the hook bus. Goal: both Trainer rows at most 1.02.

On a shared machine the speed drifts by several per cent over seconds, more than the
engine costs, so each repetition runs the hand-written loop before and after the
Trainer variants and divides by their mean: a ratio per repetition, of which the
median (and the quartiles, the spread to trust) is reported.

    .venv/bin/python benchmarks/bench_overhead.py [--threads 1] [--steps 1000] [--repeats 11]
    .venv/bin/python benchmarks/bench_overhead.py --breakdown   # + the loop without its services
    .venv/bin/python benchmarks/bench_overhead.py --quick
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from common import StepClock, parser, per_step
from slipstream import Trainer

FEATURES, HIDDEN, CLASSES, BATCH = 32, 128, 10, 64


def loader(steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * BATCH, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (steps * BATCH,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False, drop_last=True)


def mlp() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def hand_written(data: DataLoader, warmup: int) -> float:
    model, optimizer = mlp()
    loss_fn = nn.CrossEntropyLoss()
    times = []
    for x, y in data:
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter())
    return per_step(times, warmup)


# The engine services that act every batch (MFU tally, loss keeping, the metrics log's
# interval check) and those bound only when due inside an epoch: --breakdown runs the
# Trainer without them, to show what the services cost and what the loop itself costs.
PER_BATCH_SERVICES = ("engine.utilization", "engine.losses", "engine.metrics", "engine.checkpoint", "engine.evaluation")


def with_trainer(data: DataLoader, warmup: int, progress_bar: bool, without: tuple[str, ...] = ()) -> float:
    model, optimizer = mlp()
    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as sink:
        trainer = Trainer(
            model=model,
            optimizer=optimizer,
            train_data=data,
            max_duration="1ep",
            algorithms=[clock],
            run_dir=Path(tmp) / "run",
            device="cpu",
            eval_interval=None,
            checkpoint_interval=None,
            progress_bar=progress_bar,
            verbose=False,
        )
        if progress_bar:
            trainer.pm.get_plugin("engine.progress").file = sink
        for name in without:
            trainer.pm.unregister(name=name)
        trainer.fit()
    return per_step(clock.times, warmup)


def main() -> None:
    p = parser(__doc__)
    p.set_defaults(threads=1, steps=1000, warmup=50, repeats=11)
    p.add_argument("--breakdown", action="store_true", help="also the Trainer without its per-batch services")
    args = p.parse_args()
    if args.quick:
        args.steps, args.warmup, args.repeats = 300, 30, 3
    torch.set_num_threads(args.threads)
    data = loader(args.warmup + args.steps)
    variants = {
        "hand-written loop": lambda: hand_written(data, args.warmup),
        "Trainer bare": lambda: with_trainer(data, args.warmup, progress_bar=False),
        "Trainer + progress bar": lambda: with_trainer(data, args.warmup, progress_bar=True),
    }
    if args.breakdown:
        variants["Trainer, no services"] = lambda: with_trainer(
            data, args.warmup, progress_bar=False, without=PER_BATCH_SERVICES
        )
    step_s: dict[str, list[float]] = {name: [] for name in variants}
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        before = variants["hand-written loop"]()
        times = {name: run() for name, run in variants.items() if name != "hand-written loop"}
        after = variants["hand-written loop"]()
        base = (before + after) / 2
        step_s["hand-written loop"] += [before, after]
        ratios["hand-written loop"].append(after / before)
        for name, seconds in times.items():
            step_s[name].append(seconds)
            ratios[name].append(seconds / base)
    print(
        f"tiny MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}, batch {BATCH}, {args.steps} timed steps, "
        f"{args.repeats} repetitions (the loop before and after the Trainer runs), "
        f"{args.threads} thread(s)"
    )
    print(f"{'variant':<26} {'us/step':>9} {'ratio':>7}   quartiles of the ratio")
    for name, times in step_s.items():
        r = sorted(ratios[name])
        quartiles = f"{r[len(r) // 4]:.3f} - {r[(3 * len(r)) // 4]:.3f}"
        label = "(after/before)" if name == "hand-written loop" else ""
        print(f"{name:<26} {1e6 * statistics.median(times):>9.1f} {statistics.median(r):>7.3f}   {quartiles} {label}")


if __name__ == "__main__":
    main()
