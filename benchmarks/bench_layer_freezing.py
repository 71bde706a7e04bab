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

import time
from typing import Any

import torch
from slipstream_layer_freezing import LayerFreezing, LayerFreezingConfig, freeze_layers

from common import compare, parser, random_loader, report
from slipstream import Algorithm, State, hookimpl
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
    results = compare(variants, data, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                      clock=time.process_time)  # CPU time: the machine is shared
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
