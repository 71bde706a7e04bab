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

from slipstream_swa import SWA, SWAConfig, swa_update

from common import sgd_variant, step_args, time_variants
from slipstream.models import build_model


def bench(model_name: str, size: int, batch: int, args: Any) -> None:
    def variant(**options: Any):
        return sgd_variant(model_name, size, (lambda: [SWA(SWAConfig(**options))]) if options else None)

    total = args.warmup + args.steps
    variants = {
        "no swa": variant(),
        # Open from the first batch to the end: every timed step updates the average.
        "swa, update every batch": variant(swa_start="0ba", swa_end=f"{total}ba", update_interval="1ba"),
        # One update at batch 1, then the statistics pass on every later batch.
        "swa, statistics pass": variant(swa_start="1ba", swa_end="2ba", update_interval="1ba"),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # swa_end at the run's end: no statistics pass (said once per run)
        time_variants(variants, args, size=size, batch=batch,
                      title=f"{model_name} at {size} px, batch {batch}, {args.threads} threads")  # fmt: skip

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
    args = step_args(__doc__.splitlines()[0], quick_warmup=2)
    bench("resnet18", 32, 16 if args.quick else 32, args)


if __name__ == "__main__":
    main()
