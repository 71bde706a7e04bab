"""Step-wise LR: the same schedule (warm-up + cosine) updated every optimizer step
against once per epoch, on the synthetic shapes. Reports the final accuracy of both
(a short run is where per-epoch updates hurt: the whole first epoch runs at the
warm-up's starting LR, the last one far from the end of the decay) and the cost of
updating the LR every step (time per step, and the hook's own cost in microseconds).

    .venv/bin/python benchmarks/bench_stepwise_lr.py            # 2 x 5 epochs of 2000 images at 32 px
    .venv/bin/python benchmarks/bench_stepwise_lr.py --quick    # seconds
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from slipstream_stepwise_lr import StepwiseLR, StepwiseLRConfig

from common import compare, parser, report
from slipstream import Trainer
from slipstream.data import DATASET_STATS, build_datasets, build_loader
from slipstream.models import build_model
from slipstream.optim import build_optimizer


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--train-size", type=int, default=2000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW's peak LR")
    p.set_defaults(steps=15, warmup=3, repeats=2)
    args = p.parse_args()
    if args.quick:
        args.model, args.epochs, args.image_size, args.train_size = "test_resnet", 2, 16, 256
        args.steps, args.warmup, args.repeats = 5, 2, 1
    torch.set_num_threads(args.threads)

    train_set, val_set, num_classes = build_datasets(
        "synthetic",
        image_size=args.image_size,
        num_classes=args.classes,
        train_size=args.train_size,
        val_size=args.train_size // 4,
    )
    train_loader = build_loader(train_set, batch_size=args.batch)
    val_loader = build_loader(val_set, batch_size=2 * args.batch, shuffle=False, drop_last=False)

    def build(interval: str):
        def variant():
            torch.manual_seed(0)
            model = build_model(args.model, num_classes, image_size=args.image_size)
            optimizer = build_optimizer(model, "adamw", args.lr, weight_decay=0.05)
            return model, optimizer, [StepwiseLR(StepwiseLRConfig(interval=interval))]

        return variant

    variants = {"per-epoch": build("epoch"), "per-step": build("step")}

    # Accuracy: two short runs, identical but for the update interval.
    outcome, plugin, state = {}, None, None
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
            summary = trainer.fit()
        last_train_loss = trainer.metrics_log.last["train"]["loss"]
        outcome[name] = (summary["accuracy"], last_train_loss)
        print(f"{name}: accuracy {outcome[name][0]:.3f}, train loss {last_train_loss:.3f}", flush=True)
        if name == "per-step":
            plugin, state = algos[0], trainer.state

    # Overhead: interleaved timing of the loop, and the hook alone.
    results = compare(
        variants,
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
        f"\n{args.model} on synthetic {args.image_size} px, {num_classes} classes, {args.train_size} images, "
        f"{args.epochs} epochs of {len(train_loader)} steps, batch {args.batch}, AdamW {args.lr}, "
        f"warmup_cosine (warm-up 0.05dur from 0.1x)"
    )
    print(f"{'LR updated':<12} {'val accuracy':>12} {'train loss (last 20 steps)':>27}")
    for name, (acc, loss) in outcome.items():
        print(f"{name:<12} {acc:>12.3f} {loss:>27.3f}")
    report("time per step (per-step updates against per-epoch)", results)
    step_ms = 1000 * results["per-step"].median_step_s
    share = hook_us / 10 / step_ms  # percent
    print(f"the LR update hook: {hook_us:.1f} us per step ({share:.3f} % of a step)")


if __name__ == "__main__":
    main()
