"""channels_last: step time with and without, through the real Trainer, in one process.

ResNet-18 at 32 px with the CIFAR stem and with the ImageNet stem (and ResNet-50 at
96 px unless --quick), plus a ViT to show where it does nothing. With --bf16, also bf16
autocast alone and bf16 + channels_last, with the mixed_precision plugin found through
the entry points (skipped if not installed).

    .venv/bin/python benchmarks/bench_channels_last.py            # ~3 min idle
    .venv/bin/python benchmarks/bench_channels_last.py --bf16     # ~2x longer
    .venv/bin/python benchmarks/bench_channels_last.py --quick
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from slipstream_channels_last import ChannelsLast

from common import compare, mixed_precision_bf16, parser, random_loader, report
from slipstream import Algorithm
from slipstream.models import build_model

# model kwargs of the reference recipes' ResNet-18 (recipes/resnet18_baseline.yaml)
REFERENCE = {"cifar_stem": True, "channels": (16, 32, 64, 128), "stem_width": 16}



def bench(
    model_name: str, size: int, batch: int, steps: int, args: Any, bf16, label: str = "", **model_kwargs
) -> None:
    def variant(*algorithms: Callable[[], Algorithm]):
        def build():
            torch.manual_seed(0)
            model = build_model(model_name, 10, image_size=size, **model_kwargs)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            return model, optimizer, [make() for make in algorithms]

        return build

    variants = {"fp32": variant(), "channels_last": variant(ChannelsLast)}
    if bf16 is not None:
        variants["bf16"] = variant(bf16)
        variants["bf16 + channels_last"] = variant(bf16, ChannelsLast)
    steps = min(steps, args.steps)
    data = random_loader(batch * (args.warmup + steps), size, batch)
    results = compare(variants, data, steps=steps, warmup=args.warmup, repeats=args.repeats)
    report(f"{label or model_name} at {size} px, batch {batch}, {args.threads} threads", results)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--bf16", action="store_true", help="add bf16 and bf16 + channels_last variants")
    p.set_defaults(warmup=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    bf16 = mixed_precision_bf16() if args.bf16 else None
    if args.quick:
        args.steps, args.warmup, args.repeats = 3, 1, 1
        bench("resnet18", 32, 32, 3, args, bf16)
        bench("vit_tiny_patch16_224", 32, 32, 3, args, bf16, patch_size=4)
        return
    # Timed steps per model: about the same time per model, at most --steps.
    # The CIFAR stem keeps 32x32 maps in stage 1 (compute-bound); the ImageNet stem
    # leaves 8x8 at 32 px (per-layer costs dominate): the contrast is the lesson.
    # The reference recipes' network (resnet18_baseline/resnet18_fast): the CIFAR stem at
    # a quarter of the width, where NCHW leaves oneDNN's narrow convolutions underused.
    bench("resnet18", 32, 32, 12, args, bf16, label="resnet18 CIFAR stem, width 16", **REFERENCE)
    bench("resnet18", 32, 64, 4, args, bf16, label="resnet18 CIFAR stem", cifar_stem=True)
    bench("resnet18", 32, 64, 12, args, bf16)
    bench("resnet50", 96, 16, 4, args, bf16)
    bench("vit_tiny_patch16_224", 96, 32, 6, args, bf16)


if __name__ == "__main__":
    main()
