"""The built-in data sources as dataset plugins (registered by the engine's own
distribution in the ``slipstream.datasets`` entry-point group)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from slipstream.data.sources import DataRequest, DatasetPlugin
from slipstream.data.stats import DATASET_STATS
from slipstream.plugins.checks import check_plugin_options, plugin_option


def build_datasets(name: str, **options: Any) -> tuple[Any, Any, int]:
    """:func:`slipstream.data.datasets.build_datasets`, imported when a source is built
    rather than when the plugin is loaded: checking a config loads it, and torchvision
    takes over a second to import."""
    from slipstream.data.datasets import build_datasets as build

    return build(name, **options)


@dataclass
class SyntheticConfig:
    num_classes: int = 10
    train_size: int = 5000
    val_size: int = 1000


@dataclass
class SyntheticMultiLabelConfig:
    # Bounds as slipstream.data.multilabel's (not imported here: checking a config
    # should not render anything): one class per shape, four cells per image.
    num_classes: int = plugin_option(10, low=2, high=10, whole=True, note="one per shape")
    train_size: int = plugin_option(5000, low=0, whole=True)
    val_size: int = plugin_option(1000, low=0, whole=True)
    # Each image shows 1 to max_shapes different shapes, one per cell of a 2 x 2 grid.
    max_shapes: int = plugin_option(3, low=1, high=4, whole=True, note="one per cell of a 2 x 2 grid")

    def __post_init__(self) -> None:
        check_plugin_options(self)
        if self.max_shapes > self.num_classes:
            raise ValueError(
                f"max_shapes={self.max_shapes} is more than num_classes={self.num_classes}: an image shows "
                "each shape at most once"
            )


@dataclass
class CifarConfig:
    root: Optional[str] = None  # the directory that holds cifar-10-batches-py/ (or cifar-100-python/)
    download: bool = False


@dataclass
class ImageFolderConfig:
    root: Optional[str] = None  # <root>/train/<class>/*.jpg and <root>/val/<class>/*.jpg


class Synthetic(DatasetPlugin):
    """Procedurally generated shapes: learnable, deterministic, any resolution, no download."""

    name = "synthetic"
    config_class: type = SyntheticConfig
    stats = DATASET_STATS["synthetic"]

    @classmethod
    def known_num_classes(cls, data: Mapping[str, Any]) -> Optional[int]:
        return data.get("num_classes", cls.config_class.num_classes)

    def datasets(self, request: DataRequest) -> tuple[Any, Any, int]:
        c = self.config
        return build_datasets(
            self.name,
            image_size=request.image_size,
            num_classes=c.num_classes,
            train_size=c.train_size,
            val_size=c.val_size,
            seed=request.seed,
            train_geometry=request.train_geometry,
            eval_geometry=request.eval_geometry,
            eval_only=request.eval_only,
            **self.own_options(),
        )

    def own_options(self) -> dict[str, Any]:
        """What this generator takes beyond the shapes' common options."""
        return {}


class SyntheticMultiLabel(Synthetic):
    """Several shapes per image, multi-hot targets (loss.name=bce): deterministic, no download."""

    name = "synthetic_multilabel"
    config_class = SyntheticMultiLabelConfig
    stats = DATASET_STATS["synthetic_multilabel"]
    task = "multilabel"

    def own_options(self) -> dict[str, Any]:
        return {"max_shapes": self.config.max_shapes}


class Cifar10(DatasetPlugin):
    """CIFAR-10 through torchvision (data.root; data.download fetches it)."""

    name = "cifar10"
    config_class = CifarConfig
    locations = ("root",)
    num_classes = 10
    stats = DATASET_STATS["cifar10"]

    def datasets(self, request: DataRequest) -> tuple[Any, Any, int]:
        c = self.config
        return build_datasets(
            self.name,
            root=c.root,
            image_size=request.image_size,
            download=c.download,
            train_geometry=request.train_geometry,
            eval_geometry=request.eval_geometry,
            eval_only=request.eval_only,
        )


class Cifar100(Cifar10):
    """CIFAR-100 through torchvision (data.root; data.download fetches it)."""

    name = "cifar100"
    num_classes = 100
    stats = DATASET_STATS["cifar100"]


class ImageFolder(DatasetPlugin):
    """An ImageFolder tree (data.root/train/<class>/, data.root/val/<class>/); unreadable images skipped and named."""

    name = "imagefolder"
    config_class = ImageFolderConfig
    locations = ("root",)
    photos = True
    stats = DATASET_STATS["imagefolder"]

    def datasets(self, request: DataRequest) -> tuple[Any, Any, int]:
        return build_datasets(
            "imagefolder",
            root=self.config.root,
            image_size=request.image_size,
            train_geometry=request.geometry("train"),
            eval_geometry=request.geometry("eval"),
            eval_only=request.eval_only,
        )
