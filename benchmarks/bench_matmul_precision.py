"""matmul_precision on CPU: what float32 matmul precision does without a GPU.

On CUDA, "high" means TF32 tensor cores (not measurable here). On CPU, "high" changes
nothing, while "medium" lets oneDNN run fp32 matmuls (Linear layers) in bf16 on CPUs
that have it; convolutions are unaffected. ViT-tiny (matmul-bound) and ResNet-18
(convolution-bound, timm, ImageNet stem) through the real Trainer, interleaved.

    .venv/bin/python benchmarks/bench_matmul_precision.py          # ~2 min idle
    .venv/bin/python benchmarks/bench_matmul_precision.py --quick
"""

from __future__ import annotations

from typing import Any

import torch
from slipstream_matmul_precision import MatmulPrecision, MatmulPrecisionConfig

from common import compare, parser, random_loader, report
from slipstream.models import build_model


def bench(model_name: str, size: int, batch: int, args: Any, **model_kwargs: Any) -> None:
    def variant(precision: str | None):
        def build():
            torch.manual_seed(0)
            model = build_model(model_name, 10, image_size=size, **model_kwargs)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            cfg = MatmulPrecisionConfig(precision=precision) if precision else None
            return model, optimizer, [MatmulPrecision(cfg)] if precision else []

        return build

    variants = {
        f"no plugin ({torch.get_float32_matmul_precision()})": variant(None),
        "precision=high": variant("high"),
        "precision=medium": variant("medium"),
    }
    data = random_loader(batch * (args.warmup + args.steps), size, batch)
    results = compare(variants, data, steps=args.steps, warmup=args.warmup, repeats=args.repeats)
    report(f"{model_name} at {size} px, batch {batch}, {args.threads} threads", results)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.set_defaults(steps=8, warmup=2, repeats=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.steps, args.warmup, args.repeats = 3, 1, 1
        bench("vit_tiny_patch16_224", 64, 8, args, patch_size=8)
        return
    bench("vit_tiny_patch16_224", 224, 8, args)
    bench("resnet18", 32, 64, args)


if __name__ == "__main__":
    main()
