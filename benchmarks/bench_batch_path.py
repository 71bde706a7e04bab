"""Host-side batch preparation as a share of the training step: the old float32 path
against the lean uint8 path, side by side in one process, for the CIFAR-stem ResNet-18
at 32 px, batch 128, channels-last.

Batch preparation is everything from the loader yielding to the tensor the model
receives (per-item work in the dataset, collate, transfer, normalisation, memory
format), not the model step:

- before: float32 per sample (uint8 / 255), float collate, float transfer, normalise
  out of place, then a channels-last copy (the engine until this change);
- after: uint8 items and collate, uint8 transfer, then the engine's one step
  (`slipstream.services.Normalize`): float32 in channels-last, normalised in place.

The step is forward + backward + SGD step of the model on that batch. Goal: after
under 2 % of the step.

    .venv/bin/python benchmarks/bench_batch_path.py            # ~2 min idle
    .venv/bin/python benchmarks/bench_batch_path.py --quick
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from common import parser
from slipstream.data import DATASET_STATS, SyntheticShapes
from slipstream.models import build_model
from slipstream.services import Normalize
from slipstream.services.batches import to_device

CL = torch.channels_last


class FloatItems(Dataset):
    """The old dataset contract: each item converted to float32 in [0, 1] on the host."""

    def __init__(self, images: SyntheticShapes) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, target = self.images[index]
        return image.float().div_(255), target


def old_prepare(batch: Any, device: torch.device, mean: torch.Tensor, std: torch.Tensor):
    inputs, targets = to_device(batch, device)
    inputs = (inputs - mean) / std  # what the old trylast Normalize plugin did
    return inputs.contiguous(memory_format=CL), targets  # channels_last's batch_start copy


def new_prepare(batch: Any, device: torch.device, normalize: Normalize):
    return normalize(to_device(batch, device), CL)


def prepare_seconds(loader: DataLoader, prepare, batches: int) -> float:
    """Seconds per batch, from asking the loader to the model's input tensor."""
    it = iter(loader)
    start = time.perf_counter()
    for _ in range(batches):
        inputs, _ = prepare(next(it))
    if inputs.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / batches


def convert_seconds(loader: DataLoader, prepare, batches: int) -> float:
    """Seconds per batch after the loader: transfer, normalisation, memory format."""
    batch = next(iter(loader))
    start = time.perf_counter()
    for _ in range(batches):
        inputs, _ = prepare(batch)
    if inputs.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / batches


def step_seconds(model, optimizer, inputs, targets, steps: int) -> float:
    def step():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()

    step()  # warm-up
    if inputs.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if inputs.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--batches", type=int, default=20, help="batches timed per preparation run")
    p.set_defaults(steps=3)
    args = p.parse_args()
    if args.quick:
        args.batches, args.steps, args.repeats = 5, 1, 1
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    images = SyntheticShapes(args.batch * args.batches, image_size=32, seed=0)
    stats = DATASET_STATS["synthetic"]
    mean = torch.tensor(stats[0], device=device).view(1, 3, 1, 1)
    std = torch.tensor(stats[1], device=device).view(1, 3, 1, 1)
    normalize = Normalize(*stats)
    pin = device.type == "cuda"
    loaders = {
        "before (float32 path)": (
            DataLoader(FloatItems(images), batch_size=args.batch, pin_memory=pin),
            lambda b: old_prepare(b, device, mean, std),
        ),
        "after (uint8 path)": (
            DataLoader(images, batch_size=args.batch, pin_memory=pin),
            lambda b: new_prepare(b, device, normalize),
        ),
    }
    torch.manual_seed(0)
    model = build_model("resnet18", 10, image_size=32, cifar_stem=True).to(device, memory_format=CL)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    inputs, targets = new_prepare(next(iter(loaders["after (uint8 path)"][0])), device, normalize)

    prep: dict[str, list[float]] = {name: [] for name in loaders}
    convert: dict[str, list[float]] = {name: [] for name in loaders}
    steps: list[float] = []
    for _ in range(args.repeats):  # interleaved: a busy machine slows all alike
        for name, (loader, prepare) in loaders.items():
            prep[name].append(prepare_seconds(loader, prepare, args.batches))
            convert[name].append(convert_seconds(loader, prepare, args.batches))
        steps.append(step_seconds(model, optimizer, inputs, targets, args.steps))
    step_s = statistics.median(steps)
    print(
        f"CIFAR-stem ResNet-18, 32 px, batch {args.batch}, channels-last fp32, {device}, "
        f"{args.threads} threads; model step {1000 * step_s:.0f} ms"
    )
    print(f"{'batch path':<24} {'prep ms/batch':>14} {'share of step':>14} {'after loader ms':>16}")
    for name, times in prep.items():
        prep_s, conv_s = statistics.median(times), statistics.median(convert[name])
        print(
            f"{name:<24} {1000 * prep_s:>14.2f} {100 * prep_s / (prep_s + step_s):>13.2f}% "
            f"{1000 * conv_s:>16.2f}"
        )
    before, after = (statistics.median(t) for t in prep.values())
    conv_before, conv_after = (statistics.median(t) for t in convert.values())
    print(
        f"after/before: whole preparation {before / after:.1f}x faster, "
        f"the part after the loader {conv_before / conv_after:.1f}x faster"
    )


if __name__ == "__main__":
    main()
