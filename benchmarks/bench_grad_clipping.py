"""grad_clipping: the cost of clipping (it is a stabiliser, not a speed-up).

Step time of ResNet-18 at 32 px (timm, ImageNet stem) and ViT-tiny through the real
Trainer, without clipping, with clipping by norm and by value, interleaved in one
process. The ratio should stay close to 1.

    .venv/bin/python benchmarks/bench_grad_clipping.py          # ~1 min idle
    .venv/bin/python benchmarks/bench_grad_clipping.py --quick
"""

from __future__ import annotations

from typing import Any

import torch
from slipstream_grad_clipping import GradClipping, GradClippingConfig

from common import compare, parser, random_loader, report
from slipstream.models import build_model


def bench(model_name: str, size: int, batch: int, args: Any, **model_kwargs: Any) -> None:
    def variant(**clip: float):
        def build():
            torch.manual_seed(0)
            model = build_model(model_name, 10, image_size=size, **model_kwargs)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            return model, optimizer, [GradClipping(GradClippingConfig(**clip))] if clip else []

        return build

    variants = {
        "no clipping": variant(),
        "max_norm=1.0": variant(max_norm=1.0),
        "clip_value=0.1 (+ norm log)": variant(clip_value=0.1),
    }
    data = random_loader(batch * (args.warmup + args.steps), size, batch)
    results = compare(variants, data, steps=args.steps, warmup=args.warmup, repeats=args.repeats)
    report(f"{model_name} at {size} px, batch {batch}, {args.threads} threads", results)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.set_defaults(steps=10, warmup=2, repeats=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.steps, args.warmup, args.repeats = 3, 1, 1
        bench("resnet18", 32, 16, args)
        return
    bench("resnet18", 32, 64, args)
    bench("vit_tiny_patch16_224", 64, 32, args, patch_size=8)


if __name__ == "__main__":
    main()
