"""selective_backprop: what a selective step costs against a plain one.

Step time of ResNet-18 (timm) at 32 px through the real Trainer (CPU time per step),
interleaved in one process: plain; every step selective (``start=0, end=1,
interrupt=0``) keeping half the batch, scored at full size and at half size (``scale_factor=0.5``); and the plugin with
its defaults, averaged over a run (selective on every other batch of its window, 0.5 to
0.9 of the run). A selective step is a no-grad scoring pass over the whole batch (about
a third of a plain step at full size, a quarter of that at half size) plus the forward
and backward of the kept half.

    .venv/bin/python benchmarks/bench_selective_backprop.py --threads 1     # ~2 min idle
    .venv/bin/python benchmarks/bench_selective_backprop.py --threads 1 --size 64
    .venv/bin/python benchmarks/bench_selective_backprop.py --quick
"""

from __future__ import annotations

import time
from typing import Any

import torch
from slipstream_selective_backprop import SelectiveBackprop, SelectiveBackpropConfig

from common import compare, parser, random_loader, report
from slipstream.models import build_model

EVERY_STEP = {"start": 0.0, "end": 1.0, "interrupt": 0}


def bench(model_name: str, size: int, batch: int, args: Any) -> None:
    def variant(plain: bool = False, **options: Any):
        def build():
            torch.manual_seed(0)
            model = build_model(model_name, 10, image_size=size)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            algos = [] if plain else [SelectiveBackprop(SelectiveBackpropConfig(**options))]
            return model, optimizer, algos

        return build

    variants = {
        "plain": variant(plain=True),
        "every step, keep 0.5": variant(**EVERY_STEP),
        "every step, keep 0.5, scale 0.5": variant(**EVERY_STEP, scale_factor=0.5),
        "defaults (run avg)": variant(),
    }
    data = random_loader(batch * (args.warmup + args.steps), size, batch)
    results = compare(variants, data, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                      clock=time.process_time)  # CPU time: the machine is shared
    report(f"{model_name} at {size} px, batch {batch}, {args.threads} thread(s), CPU time per step", results)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.set_defaults(steps=10, warmup=2, repeats=3)
    p.add_argument("--size", type=int, default=32, help="image size (px); the scoring pass's saving grows with it")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.steps, args.warmup, args.repeats = 3, 1, 1
        bench("resnet18", 32, 16, args)
        return
    bench("resnet18", args.size, 32, args)


if __name__ == "__main__":
    main()
