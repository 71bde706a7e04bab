"""The built-in data sources' names, summaries and per-channel statistics: plain data, so that
checking a config (which reads them) imports neither torch nor torchvision."""

from __future__ import annotations

DATASET_NAMES: tuple[str, ...] = ("synthetic", "synthetic_multilabel", "cifar10", "cifar100", "imagefolder")

# `slipstream datasets` without importing them (the engine's distribution summary
# describes the engine, not each source). Kept in step with the classes' docstrings.
BUILTIN_SUMMARIES = {
    "synthetic": "Procedurally generated shapes: learnable, deterministic, any resolution, no download.",
    "synthetic_multilabel": "Several shapes per image, multi-hot targets (loss.name=bce): deterministic, no download.",
    "cifar10": "CIFAR-10 through torchvision (data.root; data.download fetches it).",
    "cifar100": "CIFAR-100 through torchvision (data.root; data.download fetches it).",
    "imagefolder": "An ImageFolder tree (data.root/train/<class>/, data.root/val/<class>/); "
    "unreadable images skipped and named.",
}

Stats = tuple[tuple[float, float, float], tuple[float, float, float]]

# Per-channel (mean, std) of the images scaled to [0, 1], for normalising on the device.
# `synthetic` was measured on 10 000 rendered 32 px train images (seed 0); the others
# are the usual published values (ImageNet's for imagefolder).
DATASET_STATS: dict[str, Stats] = {
    "synthetic": ((0.503, 0.499, 0.496), (0.289, 0.290, 0.289)),
    # 2000 rendered 32 px train images, 10 classes, seed 0
    "synthetic_multilabel": ((0.492, 0.496, 0.493), (0.288, 0.287, 0.288)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "imagefolder": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}
