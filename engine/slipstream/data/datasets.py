"""build_datasets: the train/val datasets for a `data.name`, as (uint8 C x H x W image, int).

Images stay uint8 (0-255) through collate and transfer: a quarter of the bytes of
float32, and no per-sample conversion on the host. The engine converts each batch to
float and normalises it once, on the device.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from torchvision import datasets
from torchvision.transforms import v2

from slipstream.data.decode import as_uint8, read_rgb  # noqa: F401 (re-exported)
from slipstream.data.stats import DATASET_NAMES, DATASET_STATS, Stats  # noqa: F401 (re-exported)
from slipstream.data.synthetic import SyntheticShapes
from slipstream.data.unreadable import SkippingImageFolder
from slipstream.errors import DataError, describe, network_failure  # noqa: F401 (DataError re-exported)


class ImageArray(Dataset):
    """Images held in memory as one uint8 ``N x C x H x W`` tensor, with int targets.

    Items are views of that tensor (collate copies them into the batch), resized
    per item when ``image_size`` differs from the stored size.
    """

    def __init__(
        self, images: torch.Tensor, targets: list[int], classes: list[str], image_size: int
    ) -> None:
        self.images = images
        self.targets = list(targets)
        self.classes = list(classes)
        stored = images.shape[-1]
        self.resize = None if image_size == stored else v2.Resize((image_size, image_size))

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index]
        return (image if self.resize is None else self.resize(image)), self.targets[index]


def _from_torchvision_cifar(ds: datasets.CIFAR10, image_size: int) -> ImageArray:
    # torchvision's CIFAR goes through a PIL image per item; its arrays are all we need.
    images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()
    return ImageArray(images, ds.targets, ds.classes, image_size)


def _cifar(
    name: str, root: str | os.PathLike | None, image_size: int, download: bool
) -> tuple[Dataset, Dataset, int]:
    cls = datasets.CIFAR10 if name == "cifar10" else datasets.CIFAR100
    if root is None:
        raise DataError(f"{name} needs data.root: the directory that holds {cls.base_folder}/")
    folder = Path(root) / cls.base_folder
    if not download and not folder.is_dir():
        raise DataError(
            f"{name} not found: looked for {folder}. "
            f"Set data.download=true to fetch it into {root}."
        )
    try:
        train = cls(str(root), train=True, download=download)
        val = cls(str(root), train=False, download=download)
    except Exception as err:
        offline = network_failure(err)
        if offline is not None:
            raise DataError(
                f"{name}: cannot download it into {root}: there is no network "
                f"({describe(offline)}). Offline, copy the extracted {cls.base_folder}/ "
                f"folder from a connected machine into {root} and set data.download=false"
            ) from None
        if not isinstance(err, RuntimeError):
            raise
        # torchvision's "not found or corrupted": a file missing, or one whose md5 is not
        # that of the official archive's (a re-created or subset copy fails the same way).
        raise DataError(
            f"{name} in {folder} is incomplete or corrupted ({err}): torchvision checks each file "
            f"against the md5 of the official archive, so a copy made or cut down another way "
            f"does not load as {name} either (write it as an ImageFolder tree and use "
            f"data.name=imagefolder). For a downloaded copy, delete {folder} and set "
            f"data.download=true to fetch it again."
        ) from err
    return (
        _from_torchvision_cifar(train, image_size),
        _from_torchvision_cifar(val, image_size),
        len(train.classes),
    )


def _imagefolder(root: str | os.PathLike | None, image_size: int) -> tuple[Dataset, Dataset, int]:
    layout = "<root>/train/<class>/*.jpg and <root>/val/<class>/*.jpg"
    if root is None:
        raise DataError(f"imagefolder needs data.root, laid out as {layout}")
    # On the decoded uint8 tensor: the shorter side to image_size, then the centre.
    tf = v2.Compose([v2.Resize(image_size), v2.CenterCrop(image_size)])
    splits = {}
    for split in ("train", "val"):
        path = Path(root) / split
        if not path.is_dir():
            raise DataError(f"imagefolder: {path} does not exist; expected {layout}")
        try:
            # val is evaluated: an unreadable image is left out, not counted twice through a stand-in
            splits[split] = SkippingImageFolder(str(path), transform=tf, loader=read_rgb, replace=split == "train")
        except FileNotFoundError as err:  # no class folders or no images in them
            raise DataError(f"imagefolder: {err}; expected {layout}") from err
    train, val = splits["train"], splits["val"]
    # ImageFolder numbers classes by sorted folder name, so differing folder sets would
    # silently give the same label to different classes in the two splits.
    if train.classes != val.classes:
        raise DataError(
            f"imagefolder: train and val class folders differ under {root}: "
            f"only in train {sorted(set(train.classes) - set(val.classes))}, "
            f"only in val {sorted(set(val.classes) - set(train.classes))}"
        )
    return train, val, len(train.classes)


def build_datasets(
    name: str,
    *,
    root: str | os.PathLike | None = None,
    image_size: int = 32,
    num_classes: int = 10,
    train_size: int = 5000,
    val_size: int = 1000,
    download: bool = False,
    seed: int = 0,
) -> tuple[Dataset, Dataset, int]:
    """Return `(train, val, num_classes)` for dataset `name`.

    `num_classes`, `train_size`, `val_size` and `seed` apply to `synthetic` only; the
    real datasets report their own class count.
    """
    if name == "synthetic":
        try:
            train = SyntheticShapes(train_size, image_size, num_classes, seed, "train")
            val = SyntheticShapes(val_size, image_size, num_classes, seed, "val")
        except ValueError as err:
            raise DataError(f"synthetic: {err}") from err
        return train, val, num_classes
    if name in ("cifar10", "cifar100"):
        return _cifar(name, root, image_size, download)
    if name == "imagefolder":
        return _imagefolder(root, image_size)
    raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(DATASET_NAMES)}")


def stats_of(dataset: Any) -> Stats | None:
    """The per-channel (mean, std) of a dataset a built-in source builds (synthetic
    shapes, torchvision's CIFAR-10/100 or an ImageFolder tree); None for another."""
    # CIFAR100 subclasses CIFAR10, so it is checked first.
    for cls, name in (
        (SyntheticShapes, "synthetic"),
        (datasets.CIFAR100, "cifar100"),
        (datasets.CIFAR10, "cifar10"),
        (datasets.DatasetFolder, "imagefolder"),
    ):
        if isinstance(dataset, cls):
            return DATASET_STATS[name]
    return None
