"""layer_freezing: what a step costs with the earliest layers frozen, against a plain one.

Step time of ResNet-18 (timm) at 32 px through the real Trainer (CPU time per step),
interleaved in one process: no freezing; the first 25 %, 50 % and 75 % of the layers
frozen from the start (``freeze_layers``, the plugin's functional API, at init: the steady cost once the
schedule has reached that depth); and the plugin itself with its defaults, averaged over
a run (nothing frozen in its first half, then a rising share). Frozen layers cost no
weight gradient, and no input gradient below the lowest layer still training.

    .venv/bin/python benchmarks/bench_layer_freezing.py --threads 1     # ~2 min idle
    .venv/bin/python benchmarks/bench_layer_freezing.py --quick
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from slipstream_layer_freezing import LayerFreezing, LayerFreezingConfig, freeze_layers

from common import Result, StepClock, Variant, parser, per_step, random_loader, report
from slipstream import Algorithm, State, Trainer, hookimpl
from slipstream.models import build_model


class FrozenFromTheStart(Algorithm):
    """The first ``level`` of the layers (the head aside) frozen at init."""

    name = "frozen_from_the_start"

    def __init__(self, level: float) -> None:
        super().__init__()
        self.level = level

    @hookimpl
    def init(self, state: State) -> None:
        freeze_layers(state.unwrapped_model, 1.0, freeze_start=0.0, freeze_level=self.level)


def cpu_compare(
    variants: dict[str, Variant], loader: Any, *, steps: int, warmup: int, repeats: int
) -> dict[str, Result]:
    """As ``common.compare`` (interleaved, through the real Trainer), timing each step
    in the process's CPU time (``time.process_time``, one thread): on a machine shared
    with other jobs, time spent descheduled does not count."""
    results = {name: Result(name) for name in variants}
    for _ in range(repeats):
        for name, build in variants.items():
            model, optimizer, algorithms = build()
            clock = StepClock(time.process_time)
            with tempfile.TemporaryDirectory() as tmp:
                Trainer(model=model, optimizer=optimizer, train_data=loader, max_duration=f"{warmup + steps}ba",
                        algorithms=[*algorithms, clock], run_dir=Path(tmp) / "run", device="cpu",
                        eval_interval=None, checkpoint_interval=None, progress_bar=False, verbose=False,
                        log_interval=10**9).fit()  # fmt: skip
            results[name].step_s.append(per_step(clock.times, warmup))
    return results


def bench(model_name: str, size: int, batch: int, args: Any) -> None:
    def variant(make=None):
        def build():
            torch.manual_seed(0)
            model = build_model(model_name, 10, image_size=size)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            return model, optimizer, [make()] if make else []

        return build

    variants = {
        "no freezing": variant(),
        "25% of layers frozen": variant(lambda: FrozenFromTheStart(0.25)),
        "50% of layers frozen": variant(lambda: FrozenFromTheStart(0.5)),
        "75% of layers frozen": variant(lambda: FrozenFromTheStart(0.75)),
        "layer_freezing (defaults, run avg)": variant(lambda: LayerFreezing(LayerFreezingConfig())),
    }
    data = random_loader(batch * (args.warmup + args.steps), size, batch)
    results = cpu_compare(variants, data, steps=args.steps, warmup=args.warmup, repeats=args.repeats)
    report(f"{model_name} at {size} px, batch {batch}, {args.threads} thread(s), CPU time per step", results)


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
