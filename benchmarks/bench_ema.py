"""EMA: the cost of updating the averaged weights after every optimizer step.

A torchvision ResNet-18 (11.7 M parameters) at 64 px trained through the real Trainer,
baseline and EMA runs interleaved; the EMA's cost is one fused lerp over the weights
(and BatchNorm buffers) per update, so ``update_every`` divides it.

    .venv/bin/python benchmarks/bench_ema.py            # ~1 min idle
    .venv/bin/python benchmarks/bench_ema.py --quick    # seconds
"""

from __future__ import annotations

import statistics
import time

import torch
import torchvision
from slipstream_ema import EMA, EMAConfig, ema_update

from common import compare, parser, random_loader, report


def variant(algorithms: list):
    def build():
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=10)
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), algorithms

    return build


def update_ms(repeats: int = 20) -> float:
    """Median milliseconds of one ema_update over ResNet-18's weights and buffers alone."""
    model = torchvision.models.resnet18(num_classes=10)
    live = [t.detach() for t in (*model.parameters(), *model.buffers())]
    ema = [t.clone() for t in live]
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        ema_update(ema, live, 0.999)
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=64)
    p.set_defaults(steps=10, warmup=2, repeats=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    batch, size = args.batch_size, args.image_size
    steps, warmup, repeats = args.steps, args.warmup, args.repeats
    if args.quick:
        batch, size, steps, warmup, repeats = 8, 32, 3, 1, 1

    variants = {
        "baseline": variant([]),
        "ema (every step)": variant([EMA(EMAConfig(decay=0.999))]),
        "ema (update_every=4)": variant([EMA(EMAConfig(decay=0.999, update_every=4))]),
    }
    loader = random_loader(batch * (warmup + steps), size, batch)
    results = compare(variants, loader, steps=steps, warmup=warmup, repeats=repeats)
    report(f"EMA overhead: ResNet-18 at {size} px, batch {batch}, {args.threads} threads", results)
    cost = update_ms()
    base = 1000 * results["baseline"].median_step_s
    print(f"one ema_update over 11.7 M weights: {cost:.1f} ms ({100 * cost / base:.1f} % of a step)")


if __name__ == "__main__":
    main()
