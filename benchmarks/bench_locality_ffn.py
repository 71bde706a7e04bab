"""locality_ffn: what the depth-wise convolutions cost per step, and what they buy.

(a) Step time and peak memory through the real Trainer, side by side: ViT-Tiny/16 at
    224 px (batch 8) with and without locality_ffn.
(b) A short whole run on the synthetic dataset at 32 px with a small ViT (patch 4,
    width 96, depth 6; AdamW with stepwise_lr's warm-up + cosine), with and without
    locality_ffn, same epochs: training time and final accuracy.

    .venv/bin/python benchmarks/bench_locality_ffn.py            # ~3 min idle
    .venv/bin/python benchmarks/bench_locality_ffn.py --quick
"""

from __future__ import annotations

from typing import Any

import torch
from slipstream_locality_ffn import LocalityFFN

from bench_image_size_curriculum import compare_runs, run_settings
from common import compare, parser, random_loader, report
from slipstream.models import build_model
from slipstream.optim import build_optimizer

SMALL_VIT = dict(patch_size=4, embed_dim=96, depth=6, num_heads=3)


def step_cost(model_name: str, size: int, batch: int, kwargs: dict, args: Any) -> None:
    def build(algorithms):
        def variant():
            torch.manual_seed(0)
            model = build_model(model_name, 10, image_size=size, **kwargs)
            optimizer = build_optimizer(model, "adamw", 1e-3, weight_decay=0.05)
            return model, optimizer, algorithms()

        return variant

    variants = {"ViT": build(list), "ViT + locality_ffn": build(lambda: [LocalityFFN()])}
    data = random_loader(batch * (args.warmup + args.steps), size, batch)
    results = compare(
        variants,
        data,
        steps=args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
        measure_memory=True,
    )
    report(
        f"(a) {model_name} at {size} px, batch {batch}: step time and peak memory",
        results,
        memory=True,
    )


def whole_run(args: Any) -> None:
    def build(algorithms):
        def variant():
            model = build_model("vit_tiny_patch16_224", 10, image_size=32, **SMALL_VIT)
            optimizer = build_optimizer(model, "adamw", 2e-3, weight_decay=0.05)
            return model, optimizer, ["stepwise_lr", *algorithms()]

        return variant

    variants = {"ViT": build(list), "ViT + locality_ffn": build(lambda: [LocalityFFN()])}
    title = f"(b) small ViT {SMALL_VIT} on synthetic 32 px"
    compare_runs(title, variants, image_size=32, **run_settings(args))


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=6, help="epochs of the whole-run comparison (b)")
    p.add_argument("--part", choices=("a", "b", "all"), default="all")
    p.set_defaults(steps=5, warmup=2, repeats=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model_name, size, batch, kwargs = "vit_tiny_patch16_224", 224, 8, {}
    if args.quick:
        args.steps, args.warmup, args.repeats = 2, 1, 1
        model_name, size, kwargs = "test_vit", 32, {"patch_size": 4}
    if args.part in ("a", "all"):
        step_cost(model_name, size, batch, kwargs, args)
    if args.part in ("b", "all"):
        whole_run(args)


if __name__ == "__main__":
    main()
