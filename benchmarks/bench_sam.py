"""sam: the cost of a SAM step (a second forward and backward) against a plain one.

Step time of ResNet-18 at 32 px (timm, ImageNet stem) through the real Trainer,
without sam, with sam every step and with interval=2, interleaved in one process.
Expect about 2x for every step and about 1.5x for interval=2.

    .venv/bin/python benchmarks/bench_sam.py --threads 1          # ~1 min idle
    .venv/bin/python benchmarks/bench_sam.py --quick
"""

from __future__ import annotations

from typing import Any

import torch
from slipstream_sam import Sam, SamConfig

from common import compare, parser, random_loader, report
from slipstream.models import build_model


def bench(model_name: str, size: int, batch: int, args: Any) -> None:
    def variant(**options: Any):
        def build():
            torch.manual_seed(0)
            model = build_model(model_name, 10, image_size=size)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            return model, optimizer, [Sam(SamConfig(**options))] if options else []

        return build

    variants = {"no sam": variant(), "sam": variant(rho=0.05), "sam interval=2": variant(interval=2)}
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
    bench("resnet18", 32, 32, args)


if __name__ == "__main__":
    main()
