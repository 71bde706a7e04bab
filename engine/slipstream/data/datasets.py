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
from slipstream.data.geometry import Geometry
from slipstream.data.multilabel import SyntheticMultiLabel
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
    name: str,
    root: str | os.PathLike | None,
    image_size: int,
    download: bool,
    eval_size: int | None = None,
    eval_only: bool = False,
) -> tuple[Dataset | None, Dataset, int]:
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
        train = None if eval_only else cls(str(root), train=True, download=download)
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
        None if train is None else _from_torchvision_cifar(train, image_size),
        _from_torchvision_cifar(val, eval_size or image_size),
        len(val.classes),
    )


class Geometric(Dataset):
    """``dataset``'s images cut as ``geometry`` says, per sample (its random crop seeded
    by the SampleKey the loader's sampler gives)."""

    def __init__(self, dataset: Dataset, geometry: Geometry) -> None:
        self.dataset = dataset
        self.geometry = geometry
        self.keyed = geometry.random  # build_loader's sampler gives keys with the epoch

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: int) -> tuple[torch.Tensor, int]:
        image, target = self.dataset[int(key)]
        return self.geometry.apply(image, key), target

    @property
    def classes(self) -> Any:
        return getattr(self.dataset, "classes", None)


def _cut(dataset: Dataset | None, geometry: Geometry | None) -> Dataset | None:
    """``dataset`` as ``geometry`` cuts it; itself where the geometry takes it whole at its size."""
    if dataset is None or geometry is None:
        return dataset
    if geometry.crop == "none" and not geometry.random and _sized(dataset, geometry.size):
        return dataset
    return Geometric(dataset, geometry)


def _sized(dataset: Dataset, size: int) -> bool:
    images = getattr(dataset, "images", None)
    stored = getattr(dataset, "image_size", None) or (images.shape[-1] if images is not None else None)
    return stored == size


def _imagefolder(
    root: str | os.PathLike | None, train_geometry: Geometry, eval_geometry: Geometry, eval_only: bool = False
) -> tuple[Dataset | None, Dataset, int]:
    layout = "<root>/val/<class>/*.jpg" if eval_only else "<root>/train/<class>/*.jpg and <root>/val/<class>/*.jpg"
    if root is None:
        raise DataError(f"imagefolder needs data.root, laid out as {layout}")
    splits = {}
    for split in ("val",) if eval_only else ("train", "val"):
        path = Path(root) / split
        if not path.is_dir():
            raise DataError(f"imagefolder: {path} does not exist; expected {layout}")
        geometry = train_geometry if split == "train" else eval_geometry
        try:
            # val is evaluated: an unreadable image is left out, not counted twice through a stand-in
            splits[split] = SkippingImageFolder(str(path), geometry=geometry, replace=split == "train")
        except FileNotFoundError as err:  # no class folders or no images in them
            raise DataError(f"imagefolder: {err}; expected {layout}") from err
    train, val = splits.get("train"), splits["val"]
    # ImageFolder numbers classes by sorted folder name, so differing folder sets would
    # silently give the same label to different classes in the two splits.
    if train is not None and train.classes != val.classes:
        raise DataError(
            f"imagefolder: train and val class folders differ under {root}: "
            f"only in train {sorted(set(train.classes) - set(val.classes))}, "
            f"only in val {sorted(set(val.classes) - set(train.classes))}"
        )
    return train, val, len(val.classes)


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
    train_geometry: Geometry | None = None,
    eval_geometry: Geometry | None = None,
    max_shapes: int = 3,
    eval_only: bool = False,
) -> tuple[Dataset | None, Dataset, int]:
    """Return `(train, val, num_classes)` for dataset `name`.

    `num_classes`, `train_size`, `val_size` and `seed` apply to `synthetic` and
    `synthetic_multilabel` only (`max_shapes`: the latter's most shapes per image); the
    real datasets report their own class count. The geometries
    (:mod:`slipstream.data.geometry`) cut each split's images; None: as before they
    existed (the shorter side to ``image_size`` and the centre square). ``eval_only``:
    the training split is neither read nor needed (None in its place).
    """
    if name in ("synthetic", "synthetic_multilabel"):
        # Made at any resolution: the evaluation's is drawn at its own size.
        eval_size = eval_geometry.size if eval_geometry else image_size
        try:
            if name == "synthetic":
                train = None if eval_only else SyntheticShapes(train_size, image_size, num_classes, seed, "train")
                val = SyntheticShapes(val_size, eval_size, num_classes, seed, "val")
            else:
                shapes = SyntheticMultiLabel
                train = None if eval_only else shapes(train_size, image_size, num_classes, seed, "train", max_shapes)
                val = shapes(val_size, eval_size, num_classes, seed, "val", max_shapes)
        except ValueError as err:
            raise DataError(f"{name}: {err}") from err
        return _cut(train, train_geometry), _cut(val, eval_geometry), num_classes
    if name in ("cifar10", "cifar100"):
        eval_size = eval_geometry.size if eval_geometry else None
        train, val, classes = _cifar(name, root, image_size, download, eval_size, eval_only)
        return _cut(train, train_geometry), _cut(val, eval_geometry), classes
    if name == "imagefolder":
        geometry = train_geometry or Geometry(image_size), eval_geometry or Geometry(image_size)
        return _imagefolder(root, *geometry, eval_only=eval_only)
    raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(DATASET_NAMES)}")


def stats_of(dataset: Any) -> Stats | None:
    """The per-channel (mean, std) of a dataset a built-in source builds (synthetic
    shapes, torchvision's CIFAR-10/100 or an ImageFolder tree); None for another."""
    # CIFAR100 subclasses CIFAR10, so it is checked first.
    for cls, name in (
        (SyntheticShapes, "synthetic"),
        (SyntheticMultiLabel, "synthetic_multilabel"),
        (datasets.CIFAR100, "cifar100"),
        (datasets.CIFAR10, "cifar10"),
        (datasets.DatasetFolder, "imagefolder"),
    ):
        if isinstance(dataset, cls):
            return DATASET_STATS[name]
    return None
