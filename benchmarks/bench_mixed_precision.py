"""mixed_precision: bf16 autocast speed-up in plain PyTorch and through the engine.

For each model, four variants run interleaved in one process (A B C D A B C D ...):
a plain PyTorch loop in fp32 and in bf16 autocast (the reference speed-up), and the
Slipstream Trainer without and with the mixed_precision plugin. The plugin should
deliver the plain loop's speed-up (within 5 %). ResNets are timm's; `resnet18_cifar`
has the CIFAR stem (model.cifar_stem), the others the ImageNet stem. Ratios are printed for wall
time and for process CPU time (the latter is the one to trust on a busy machine,
with --threads 1).

    .venv/bin/python benchmarks/bench_mixed_precision.py            # ResNet-18 (both stems), ViT-tiny
    .venv/bin/python benchmarks/bench_mixed_precision.py --models resnet18_cifar,resnet50
    .venv/bin/python benchmarks/bench_mixed_precision.py --quick
"""

from __future__ import annotations

import time
from typing import Any

import torch
from slipstream_mixed_precision import MixedPrecision, MixedPrecisionConfig
from torch.utils.data import DataLoader

from common import Result, StepClock, parser, per_step, random_loader, report, run_variant
from slipstream.models import build_model


def build(model_name: str, size: int, dtype: str | None, clocks: list, **model_kwargs: Any):
    def make():
        torch.manual_seed(0)
        model = build_model(model_name, 10, image_size=size, **model_kwargs)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        # Process CPU time: on a shared machine wall time mostly measures the neighbours.
        clocks.append(StepClock(time.process_time, name="bench_cpu_clock"))
        algos = [MixedPrecision(MixedPrecisionConfig(dtype=dtype))] if dtype else []
        return model, optimizer, [*algos, clocks[-1]]

    return make


def plain_loop(make, loader: DataLoader, steps: int, warmup: int, bf16: bool):
    """(wall, CPU) seconds per step of the loop one would write by hand: same model,
    data, loss, optimizer and zero_grad as the engine's defaults."""
    model, optimizer, _ = make()
    model.train()
    loss_fn = torch.nn.CrossEntropyLoss()
    wall, cpu = [], []
    batches = iter(loader)
    for _ in range(warmup + steps):
        inputs, targets = next(batches)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(model(inputs), targets)
        loss.float().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        wall.append(time.perf_counter())
        cpu.append(time.process_time())
    return per_step(wall, warmup), per_step(cpu, warmup)


def bench(model_name: str, size: int, batch: int, args: Any, **model_kwargs: Any) -> None:
    steps, warmup = args.steps, args.warmup
    loader = random_loader(batch * (warmup + steps), size, batch)
    clocks: list[StepClock] = []
    fp32 = build(model_name, size, None, clocks, **model_kwargs)
    bf16 = build(model_name, size, "bf16", clocks, **model_kwargs)

    def engine(make):
        wall = run_variant(make, loader, steps, warmup)[0]
        return wall, per_step(clocks[-1].times, warmup)

    runs = {
        "plain fp32": lambda: plain_loop(fp32, loader, steps, warmup, bf16=False),
        "plain bf16": lambda: plain_loop(bf16, loader, steps, warmup, bf16=True),
        "engine fp32": lambda: engine(fp32),
        "engine + mixed_precision": lambda: engine(bf16),
    }
    wall = {name: Result(name) for name in runs}
    cpu = {name: Result(name) for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            w, c = run()
            wall[name].step_s.append(w)
            cpu[name].step_s.append(c)
    title = f"{model_name} at {size} px, batch {batch}, {args.threads} threads"
    names = list(runs)
    for clock, results in (("wall time", wall), ("process CPU time", cpu)):
        report(f"{title}, {clock}: plain PyTorch", {n: results[n] for n in names[:2]})
        report(f"{title}, {clock}: engine", {n: results[n] for n in names[2:]})
        step = {name: r.median_step_s for name, r in results.items()}
        plain = step["plain fp32"] / step["plain bf16"]
        engine_ratio = step["engine fp32"] / step["engine + mixed_precision"]
        overhead = step["engine fp32"] / step["plain fp32"]
        print(
            f"bf16 speed-up ({clock}): plain {plain:.2f}x, engine {engine_ratio:.2f}x "
            f"(engine/plain {engine_ratio / plain:.3f}; "
            f"engine fp32 step / plain fp32 step {overhead:.3f})\n",
            flush=True,
        )


# --models key: (timm name, image size, batch size, model options)
MODELS = {
    # The compute-bound reference: 3x3 stride-1 stem, no max-pool, 32x32 maps in stage 1.
    "resnet18_cifar": ("resnet18", 32, 128, {"cifar_stem": True}),
    # The ImageNet stem at 32 px leaves 8x8 maps: per-layer costs dominate the step.
    "resnet18": ("resnet18", 32, 128, {}),
    "vit_tiny": ("vit_tiny_patch16_224", 224, 8, {}),
    "resnet50": ("resnet50", 96, 32, {}),
}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet18_cifar,resnet18,vit_tiny",
                   help="comma-separated, from: " + ", ".join(MODELS))
    p.set_defaults(steps=8, warmup=2, repeats=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.steps, args.warmup, args.repeats = 3, 1, 1
        bench("resnet18", 32, 32, args)
        bench("vit_tiny_patch16_224", 64, 4, args)
        return
    for key in args.models.split(","):
        name, size, batch, options = MODELS[key]
        bench(name, size, batch, args, **options)


if __name__ == "__main__":
    main()
