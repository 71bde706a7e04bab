"""swa: the per-step cost of stochastic weight averaging against plain training.

Step time of ResNet-18 at 32 px (timm, ImageNet stem) through the real Trainer,
interleaved in one process: without swa; inside the averaging window with an update
after every batch (the worst case: Composer's default updates once an epoch); inside
the batch-norm statistics pass (one extra no-grad forward of the average per batch);
and one ``swa_update`` over the 11.7 M weights alone.

    .venv/bin/python benchmarks/bench_swa.py --threads 1 --steps 8 --repeats 5   # ~1.5 min idle
    .venv/bin/python benchmarks/bench_swa.py --quick
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
from slipstream_swa import SWA, SWAConfig, swa_update

from common import compare, parser, random_loader, report
from slipstream.models import build_model


def bench(model_name: str, size: int, batch: int, args: Any) -> None:
    def variant(**options: Any):
        def build():
            torch.manual_seed(0)
            model = build_model(model_name, 10, image_size=size)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            return model, optimizer, [SWA(SWAConfig(**options))] if options else []

        return build

    total = args.warmup + args.steps
    variants = {
        "no swa": variant(),
        # Open from the first batch to the end: every timed step updates the average.
        "swa, update every batch": variant(swa_start="0ba", swa_end=f"{total}ba", update_interval="1ba"),
        # One update at batch 1, then the statistics pass on every later batch.
        "swa, statistics pass": variant(swa_start="1ba", swa_end="2ba", update_interval="1ba"),
    }
    data = random_loader(batch * total, size, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # swa_end at the run's end: no statistics pass (said once per run)
        results = compare(variants, data, steps=args.steps, warmup=args.warmup, repeats=args.repeats)
    report(f"{model_name} at {size} px, batch {batch}, {args.threads} threads", results)

    model = build_model(model_name, 10, image_size=size)
    live = list(model.state_dict().values())
    average = [t.clone() for t in live]
    swa_update(average, live, 1)  # warm
    rounds = 20
    started = time.perf_counter()
    for n in range(rounds):
        swa_update(average, live, n + 1)
    each = (time.perf_counter() - started) / rounds
    weights = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"one swa_update over {weights:.1f} M weights: {1000 * each:.2f} ms", flush=True)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.set_defaults(steps=10, warmup=2, repeats=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.steps, args.warmup, args.repeats = 3, 2, 1
        bench("resnet18", 32, 16, args)
        return
    bench("resnet18", 32, 32, args)


if __name__ == "__main__":
    main()
