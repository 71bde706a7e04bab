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

from slipstream_layer_freezing import LayerFreezing, LayerFreezingConfig, freeze_layers

from common import sgd_variant, step_args, time_variants
from slipstream import Algorithm, State, hookimpl


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
        return sgd_variant(model_name, size, (lambda: [make()]) if make else None)

    variants = {
        "no freezing": variant(),
        "25% of layers frozen": variant(lambda: FrozenFromTheStart(0.25)),
        "50% of layers frozen": variant(lambda: FrozenFromTheStart(0.5)),
        "75% of layers frozen": variant(lambda: FrozenFromTheStart(0.75)),
        "layer_freezing (defaults, run avg)": variant(lambda: LayerFreezing(LayerFreezingConfig())),
    }
    title = f"{model_name} at {size} px, batch {batch}, {args.threads} thread(s), CPU time per step"
    time_variants(variants, args, size=size, batch=batch, title=title, clock=time.process_time)  # the machine is shared


def main() -> None:
    args = step_args(__doc__.splitlines()[0])
    bench("resnet18", 32, 16 if args.quick else 32, args)


if __name__ == "__main__":
    main()
