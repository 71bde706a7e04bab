"""image_size_curriculum: what a smaller image saves per step, and a short run with it.

(a) Step time through the real Trainer, side by side: data at full size, data at half
    size, and full-size data resized on the device by the plugin (held at its initial
    scale, so the resize's own cost is included). ResNet-18 at 32 vs 16 px and
    ViT-Tiny/16 at 224 vs 112 px.
(b) A short whole run on the synthetic dataset (ResNet-18, 32 px, AdamW with
    stepwise_lr's warm-up + cosine): fixed size vs the default linear curriculum, same
    epochs: training time and final accuracy.

    .venv/bin/python benchmarks/bench_image_size_curriculum.py            # ~3 min idle
    .venv/bin/python benchmarks/bench_image_size_curriculum.py --quick
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

import torch
from slipstream_image_size_curriculum import ImageSizeCurriculum, ImageSizeCurriculumConfig

from common import Variant, compare, parser, random_loader, report
from slipstream import Trainer
from slipstream.data import DATASET_STATS, build_datasets, build_loader
from slipstream.models import build_model
from slipstream.optim import build_optimizer


def held_at_half() -> ImageSizeCurriculum:
    """The plugin resizing every batch to half size (its initial scale, never left)."""
    return ImageSizeCurriculum(ImageSizeCurriculumConfig(initial_scale=0.5, delay=1.0, finetune=0.0))


def step_times(model_name: str, full: int, batch: int, args: Any) -> None:
    half = full // 2

    def build(algorithms):
        def variant():
            torch.manual_seed(0)
            model = build_model(model_name, 10, image_size=full)
            return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), algorithms()

        return variant

    n = batch * (args.warmup + args.steps)
    loaders = {full: random_loader(n, full, batch), half: random_loader(n, half, batch)}
    names = {
        f"{full} px data": (build(list), full),
        f"{half} px data": (build(list), half),
        f"{full} px, plugin -> {half} px": (build(lambda: [held_at_half()]), full),
    }
    results = compare(
        {name: variant for name, (variant, _) in names.items()},
        lambda name: loaders[names[name][1]],
        steps=args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
    )
    report(f"(a) {model_name}, batch {batch}: step time", results)


@functools.cache
def synthetic(image_size: int, train_size: int, val_size: int) -> tuple[Any, Any]:
    train, val, _ = build_datasets(
        "synthetic", image_size=image_size, num_classes=10, train_size=train_size, val_size=val_size
    )
    return train, val


def compare_runs(
    title: str,
    variants: dict[str, Variant],
    *,
    image_size: int,
    epochs: int,
    train_size: int,
    val_size: int,
    batch_size: int,
) -> dict[str, dict[str, Any]]:
    """Train each variant on the synthetic dataset through the real Trainer, one after
    the other, and print training time (evaluation excluded) and final accuracy."""
    train, val = synthetic(image_size, train_size, val_size)
    runs = {}
    for name, build in variants.items():
        torch.manual_seed(0)
        model, optimizer, algorithms = build()
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(
                model=model,
                optimizer=optimizer,
                train_data=build_loader(train, batch_size=batch_size),
                eval_data=build_loader(val, batch_size=2 * batch_size, shuffle=False, drop_last=False),
                max_duration=f"{epochs}ep",
                algorithms=algorithms,
                run_dir=Path(tmp) / "run",
                device="cpu",
                eval_interval=None,
                checkpoint_interval=None,
                normalize=DATASET_STATS["synthetic"],
                progress_bar=False,
                verbose=False,
                log_interval=10**9,
            )
            summary = trainer.fit()
        summary["train_s"] = summary["wall_time_s"] - summary.get("eval_time_s", 0.0)
        runs[name] = summary
    base = next(iter(runs.values()))["train_s"]
    print(f"{title}, {epochs} epochs of {train_size} images (batch {batch_size}), {val_size} to evaluate")
    print(f"{'variant':<28} {'train s':>8} {'speed-up':>9} {'accuracy':>9}")
    for name, s in runs.items():
        print(f"{name:<28} {s['train_s']:>8.1f} {base / s['train_s']:>8.2f}x {s['accuracy']:>9.3f}")
    return runs


def run_settings(args: Any) -> dict[str, int]:
    """The whole-run comparison's size: AdamW with stepwise_lr's warm-up + cosine."""
    if args.quick:
        return dict(epochs=1, train_size=256, val_size=128, batch_size=64)
    return dict(epochs=args.epochs, train_size=4000, val_size=1000, batch_size=128)


def whole_run(args: Any) -> None:
    def build(algorithms):
        def variant():
            model = build_model(args.run_model, 10, image_size=32)
            optimizer = build_optimizer(model, "adamw", 2e-3, weight_decay=0.05)
            return model, optimizer, ["stepwise_lr", *algorithms()]

        return variant

    variants = {
        "fixed 32 px": build(list),
        "curriculum (linear)": build(lambda: [ImageSizeCurriculum()]),
    }
    compare_runs(f"(b) {args.run_model} on synthetic 32 px", variants, image_size=32, **run_settings(args))


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=6, help="epochs of the whole-run comparison (b)")
    p.add_argument("--run-model", default="resnet18", help="model of the whole-run comparison (b)")
    p.add_argument("--part", choices=("a", "b", "all"), default="all")
    p.set_defaults(steps=6, warmup=2, repeats=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cases = [("resnet18", 32, 32), ("vit_tiny_patch16_224", 224, 8)]
    if args.quick:
        args.steps, args.warmup, args.repeats, args.run_model = 2, 1, 1, "test_resnet"
        cases = [("test_resnet", 32, 8), ("test_vit", 32, 8)]
    if args.part in ("a", "all"):
        for model_name, full, batch in cases:
            step_times(model_name, full, batch, args)
    if args.part in ("b", "all"):
        whole_run(args)


if __name__ == "__main__":
    main()
