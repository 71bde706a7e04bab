"""Activation checkpointing: peak training memory and time per step, with vs without.

Two models, each trained through the real Trainer, baseline and checkpointed runs
interleaved: timm's ViT-Ti/16 at 224 px (timm's own set_grad_checkpointing) and a
torchvision ResNet-50 at 112 px (blocks wrapped by the plugin's torch.utils.checkpoint
path). Memory is the peak resident-set growth during training on CPU (allocator peak
on CUDA), a coarse measure on a shared machine; so the script also prints the exact
bytes of activations the forward pass saves for backward, with and without.

    .venv/bin/python benchmarks/bench_activation_checkpointing.py            # ~1-2 min idle
    .venv/bin/python benchmarks/bench_activation_checkpointing.py --quick    # seconds
"""

from __future__ import annotations

from collections.abc import Callable

import timm
import torch
import torchvision
from slipstream_activation_checkpointing import ActivationCheckpointing
from torch import nn

from common import compare, parser, random_loader, report
from slipstream import Duration, State


def variants(build: Callable[[], nn.Module]) -> dict:
    def make(algorithms: list) -> Callable:
        def variant():
            torch.manual_seed(0)
            model = build()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            return model, optimizer, algorithms

        return variant

    return {"baseline": make([]), "activation_checkpointing": make([ActivationCheckpointing()])}


def saved_activation_mib(model: nn.Module, x: torch.Tensor) -> float:
    """MiB of activations (weights excluded) autograd saves in one training forward."""
    weights = {p.data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in weights:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(storages.values()) / 2**20


def activations_line(build: Callable[[], nn.Module], batch: int, size: int) -> str:
    x = torch.rand(batch, 3, size, size)
    off = saved_activation_mib(build(), x)
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    ActivationCheckpointing().init(State(model, optimizer, Duration.parse("1ep")))
    on = saved_activation_mib(model, x)
    return f"activations saved for backward: {off:.0f} MiB -> {on:.0f} MiB ({on / off:.2f}x)"


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--resnet", default="resnet50", help="torchvision ResNet (resnet18, resnet50)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.set_defaults(steps=4, warmup=1, repeats=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    def vit():
        return timm.create_model("vit_tiny_patch16_224", num_classes=10)

    def test_vit():
        return timm.create_model("test_vit", num_classes=10, img_size=64)

    def resnet():
        return getattr(torchvision.models, args.resnet)(num_classes=10)

    cases = [
        ("ViT-Ti/16 at 224 px (timm path)", vit, 224),
        (f"torchvision {args.resnet} at 112 px (modules path)", resnet, 112),
    ]
    batch, steps, warmup, repeats = args.batch_size, args.steps, args.warmup, args.repeats
    if args.quick:
        cases = [
            ("timm test_vit at 64 px (timm path)", test_vit, 64),
            (f"torchvision {args.resnet} at 64 px (modules path)", resnet, 64),
        ]
        batch, steps, warmup, repeats = 8, 2, 1, 1

    for title, build, size in cases:
        loader = random_loader(batch * (warmup + steps), size, batch)
        results = compare(
            variants(build), loader, steps=steps, warmup=warmup, repeats=repeats,
            measure_memory=True, device=args.device,
        )
        heading = f"\n{title}, batch {batch}, {args.threads} threads, {args.device}"
        report(heading, results, memory=True)
        print(activations_line(build, batch, size), flush=True)


if __name__ == "__main__":
    main()
