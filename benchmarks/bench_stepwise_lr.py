"""Step-wise LR: the same schedule (warm-up + cosine) updated every optimizer step
against once per epoch, on the synthetic shapes. Reports the final accuracy of both
(a short run is where per-epoch updates hurt: the whole first epoch runs at the
warm-up's starting LR, the last one far from the end of the decay) and the cost of
updating the LR every step (time per step, and the hook's own cost in microseconds).

    .venv/bin/python benchmarks/bench_stepwise_lr.py            # ~2-3 min on 2 idle cores
    .venv/bin/python benchmarks/bench_stepwise_lr.py --quick    # seconds
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from common import compare, parser, report
from slipstream import Trainer
from slipstream.data import DATASET_STATS, build_datasets, build_loader
from slipstream.models import build_model
from slipstream.optim import build_optimizer
from slipstream_stepwise_lr import StepwiseLR, StepwiseLRConfig


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--train-size", type=int, default=2000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.1)
    args = p.parse_args()
    if args.quick:
        args.model, args.epochs, args.image_size, args.train_size = "test_resnet", 2, 16, 256
        args.steps, args.warmup, args.repeats = 5, 2, 1
    torch.set_num_threads(args.threads)

    train_set, val_set, num_classes = build_datasets(
        "synthetic",
        image_size=args.image_size,
        num_classes=10,
        train_size=args.train_size,
        val_size=args.train_size // 4,
    )
    train_loader = build_loader(train_set, batch_size=args.batch)
    val_loader = build_loader(val_set, batch_size=2 * args.batch, shuffle=False, drop_last=False)

    def build(interval: str | None):
        def variant():
            torch.manual_seed(0)
            model = build_model(args.model, num_classes, image_size=args.image_size)
            optimizer = build_optimizer(
                model, "sgd", args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4
            )
            algos = [] if interval is None else [StepwiseLR(StepwiseLRConfig(interval=interval))]
            return model, optimizer, algos

        return variant

    variants = {"constant LR": build(None), "per-epoch": build("epoch"), "per-step": build("step")}

    # Accuracy: full short runs, identical but for the update interval.
    accuracy, plugin, state = {}, None, None
    for name, variant in variants.items():
        model, optimizer, algos = variant()
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(
                model=model,
                optimizer=optimizer,
                train_data=train_loader,
                eval_data=val_loader,
                max_duration=f"{args.epochs}ep",
                algorithms=algos,
                run_dir=Path(tmp) / "run",
                normalize=DATASET_STATS["synthetic"],
                eval_interval=None,
                checkpoint_interval=None,
                progress_bar=False,
                verbose=False,
            )
            trainer.checkpointer.write = False
            summary = trainer.fit()
        accuracy[name] = summary["accuracy"]
        if algos and algos[0].config.interval == "step":
            plugin, state = algos[0], trainer.state

    # Overhead: interleaved timing of the loop, and the hook alone.
    results = compare(
        {k: v for k, v in variants.items() if k != "constant LR"},
        train_loader,
        steps=args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
    )
    calls = 10_000
    started = time.perf_counter()
    for _ in range(calls):
        plugin.before_optimizer_step(state)
    hook_us = (time.perf_counter() - started) / calls * 1e6

    print(
        f"\n{args.model} on synthetic {args.image_size} px, {args.train_size} images, "
        f"{args.epochs} epochs of {len(train_loader)} steps, batch {args.batch}, lr {args.lr}, "
        f"schedule warmup_cosine (warm-up 0.05dur from 0.1x)"
    )
    for name, acc in accuracy.items():
        print(f"  final accuracy {name:<12} {acc:.3f}")
    report("time per step (per-step updates against per-epoch)", results)
    step_ms = 1000 * results["per-step"].median_step_s
    print(
        f"the LR update hook: {hook_us:.1f} us per step ({hook_us / 10 / step_ms:.3f} % of a step)"
    )


if __name__ == "__main__":
    main()
