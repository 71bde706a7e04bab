"""`DatasetPlugin`, the base class of every data source (``data.name``), and what the
engine asks of one (:class:`DataRequest`) and gets back (:class:`BuiltData`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from slipstream.data.stats import Stats
from slipstream.plugins.base import Plugin

DATASETS_GROUP = "slipstream.datasets"


@dataclass
class DataRequest:
    """What every dataset plugin is asked for: the engine's common ``data.*`` keys,
    plus the run's seed and this process's place (rank of world_size)."""

    image_size: int = 32
    batch_size: int = 128  # per process
    eval_batch_size: int = 256  # per process
    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    drop_last: bool = True  # of the training data; evaluation keeps every sample
    # Repeated augmentation (data.repeats): each training sample this many times in an
    # epoch of the same length, each copy cropped differently (slipstream.data.EpochSampler).
    repeats: int = 1
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    # How training and evaluation images are cut to size (slipstream.data.geometry.Geometry);
    # None: the shorter side to image_size and the centre square, as before these existed.
    train_geometry: Any = None
    eval_geometry: Any = None
    # Only the evaluation data is wanted (another of data.eval_sets): a plugin may skip its
    # training split (datasets() returning None for it; BuiltData.train None), so a set
    # needs no train folder (ImageNet-V2 has none) and builds nothing it never reads.
    eval_only: bool = False

    def geometry(self, split: str) -> Any:
        """The ``train`` or ``eval`` geometry, the plain centre crop where none is given."""
        from slipstream.data.geometry import Geometry

        given = self.train_geometry if split == "train" else self.eval_geometry
        return given if given is not None else Geometry(self.image_size, seed=self.seed)


@dataclass
class BuiltData:
    """A dataset plugin's result. ``train``/``eval`` are iterables of
    ``(uint8 images, int64 targets)`` batches (float32 ``(N, num_classes)`` multi-hot
    targets for a ``task = "multilabel"`` plugin); a ``train.sampler`` with
    ``set_epoch(epoch, start_batch)`` and ``batches_per_epoch`` makes the order a
    function of (seed, epoch) and mid-epoch resume exact."""

    train: Any
    eval: Any
    num_classes: int
    stats: Optional[Stats] = None  # per-channel (mean, std) in [0, 1] units; None: not normalised


class DatasetPlugin(Plugin):
    """Base class of a data source (``data.name``).

    Subclasses set ``name``, optionally ``config_class`` (a dataclass of the keys it
    reads from the ``data`` section; ``__post_init__`` may raise ``ValueError``) and
    ``stats``, and implement either :meth:`build` or :meth:`datasets` (map-style
    datasets; the engine then builds its deterministic, rank-aware loaders).
    """

    kind: ClassVar[str] = "dataset"
    stats: ClassVar[Optional[Stats]] = None
    # Its data.* keys that say where the data is (a folder, shard patterns): a resume,
    # autoresume included, may find the same data elsewhere (a requeued job that staged
    # it on another node's disk), so these are not compared with the checkpoint's.
    locations: ClassVar[tuple[str, ...]] = ()
    # The classes it has whatever its options (cifar10's 10); None: only its data says.
    num_classes: ClassVar[Optional[int]] = None
    # Whether its images are photos of any size (a random resized crop and flips for
    # training, timm's 0.875 centre crop for evaluation by default), or made at their
    # size (synthetic, CIFAR: taken whole).
    photos: ClassVar[bool] = False
    # What its targets are: "multiclass" (one class index per image, int64) or
    # "multilabel" (a multi-hot float vector of num_classes per image; loss.name=bce).
    task: ClassVar[str] = "multiclass"
    # Whether it streams its samples (its own loader, not the engine's map-style one):
    # a stream's loader starts its workers each epoch, so data.persistent_workers is not read.
    streams: ClassVar[bool] = False

    @classmethod
    def known_num_classes(cls, data: Mapping[str, Any]) -> Optional[int]:
        """The classes a run has, where its ``data`` section alone says (None: unknown
        before the data is read). :attr:`num_classes` unless a subclass's options say."""
        return cls.num_classes

    def datasets(self, request: DataRequest) -> tuple[Any, Any, int]:
        """``(train, val, num_classes)`` as map-style datasets of ``(uint8 C x H x W, int)``;
        ``val`` may be None (no evaluation data)."""
        raise NotImplementedError(f"dataset {self.name!r} implements neither build() nor datasets()")

    def build(self, request: DataRequest) -> BuiltData:
        """The train and eval data of rank ``request.rank`` of ``request.world_size``."""
        from slipstream.data.loaders import build_loader

        train, val, num_classes = self.datasets(request)
        if request.eval_only:
            train = None
        common = dict(
            seed=request.seed,
            rank=request.rank,
            world_size=request.world_size,
            num_workers=request.num_workers,
            pin_memory=request.pin_memory,
            persistent_workers=request.persistent_workers,
        )
        return BuiltData(
            train=None
            if train is None
            else build_loader(
                train,
                batch_size=request.batch_size,
                shuffle=True,
                drop_last=request.drop_last,
                repeats=request.repeats,
                **common,
            ),
            eval=None
            if val is None
            else build_loader(val, batch_size=request.eval_batch_size, shuffle=False, drop_last=False, **common),
            num_classes=num_classes,
            stats=self.stats,
        )
