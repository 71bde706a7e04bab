"""Dataset plugins: entry-point group ``slipstream.datasets``, one per ``data.name``.

A dataset plugin is a class with a ``name``, an optional ``config_class`` dataclass
(its own ``data.<key>`` options, checked like an algorithm's) and a ``build`` method
that returns the train and eval data of one rank. The four built-ins (synthetic,
cifar10, cifar100, imagefolder) are registered by the engine's own distribution, the
same way a third party registers one::

    [project.entry-points."slipstream.datasets"]
    my_data = "my_package:MyData"

Every source keeps the lean batch path: items are ``(uint8 C x H x W, int)``; the
engine converts batches to float and normalises them on the device with ``stats``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from slipstream.errors import ConfigError, did_you_mean
from slipstream.plugins.base import Plugin

DATASETS_GROUP = "slipstream.datasets"

Stats = tuple[tuple[float, float, float], tuple[float, float, float]]

# `slipstream datasets` without importing them (the engine's distribution summary
# describes the engine, not each source). Kept in step with the classes' docstrings.
BUILTIN_SUMMARIES = {
    "synthetic": "Procedurally generated shapes: learnable, deterministic, any resolution, no download.",
    "cifar10": "CIFAR-10 through torchvision (data.root; data.download fetches it).",
    "cifar100": "CIFAR-100 through torchvision (data.root; data.download fetches it).",
    "imagefolder": "An ImageFolder tree (data.root/train/<class>/, data.root/val/<class>/); "
    "unreadable images skipped and named.",
}

# The engine's own data.* keys, read for every source; anything else in the data
# section belongs to the chosen dataset plugin (its config_class).
COMMON_KEYS: tuple[str, ...] = (
    "name",
    "image_size",
    "batch_size",
    "eval_batch_size",
    "num_workers",
    "pin_memory",
    "persistent_workers",
    "drop_last",
    "normalize",
)


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
    seed: int = 0
    rank: int = 0
    world_size: int = 1


@dataclass
class BuiltData:
    """A dataset plugin's result. ``train``/``eval`` are iterables of
    ``(uint8 images, int64 targets)`` batches; a ``train.sampler`` with
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

    def datasets(self, request: DataRequest) -> tuple[Any, Any, int]:
        """``(train, val, num_classes)`` as map-style datasets of ``(uint8 C x H x W, int)``;
        ``val`` may be None (no evaluation data)."""
        raise NotImplementedError(f"dataset {self.name!r} implements neither build() nor datasets()")

    def build(self, request: DataRequest) -> BuiltData:
        """The train and eval data of rank ``request.rank`` of ``request.world_size``."""
        from slipstream.data.loaders import build_loader

        train, val, num_classes = self.datasets(request)
        common = dict(
            seed=request.seed,
            rank=request.rank,
            world_size=request.world_size,
            num_workers=request.num_workers,
            pin_memory=request.pin_memory,
            persistent_workers=request.persistent_workers,
        )
        return BuiltData(
            train=build_loader(
                train, batch_size=request.batch_size, shuffle=True, drop_last=request.drop_last, **common
            ),
            eval=None
            if val is None
            else build_loader(val, batch_size=request.eval_batch_size, shuffle=False, drop_last=False, **common),
            num_classes=num_classes,
            stats=self.stats,
        )


def discover_datasets(load: bool = False) -> dict[str, Any]:
    """Every installed dataset plugin, by name (see :func:`slipstream.plugins.discovery.discover`)."""
    from slipstream.plugins.discovery import discover

    return discover(load=load, group=DATASETS_GROUP)


def dataset_class(name: str, installed: dict[str, Any] | None = None) -> type[DatasetPlugin]:
    """The plugin registered as ``data.name=name``, or a ConfigError listing the installed ones."""
    from slipstream.plugins.discovery import algorithm_class

    installed = discover_datasets() if installed is None else installed
    if name not in installed:
        raise ConfigError(
            f"data.name={name!r}: no such dataset is installed{did_you_mean(name, installed)}; "
            f"installed datasets: {', '.join(sorted(installed)) or 'none'}"
        )
    try:
        return algorithm_class(name, installed, DATASETS_GROUP)  # type: ignore[return-value]
    except Exception as exc:  # PluginError: a broken plugin is a config problem of this run
        raise ConfigError(f"data.name={name!r}: {exc}") from None


def data_locations(config: Any) -> list[str]:
    """The dotted ``data.*`` keys that locate the data of the dataset ``config`` (a run's
    config mapping) names; none where that dataset is not installed."""
    name = ((config or {}).get("data") or {}).get("name")
    try:
        cls = dataset_class(str(name))
    except ConfigError:
        return []
    return [f"data.{key}" for key in cls.locations]


def dataset_keys(cls: type[DatasetPlugin]) -> list[str]:
    """The ``data.*`` keys a dataset plugin declares (besides the common ones)."""
    if cls.config_class is None:
        return []
    return [f.name for f in dataclasses.fields(cls.config_class)]


def dataset_config(cls: type[DatasetPlugin], options: dict[str, Any]) -> Any:
    """Validate a plugin's ``data.*`` options against its config_class: an unknown
    key, a wrong type or an out-of-range value names ``data.<key>`` and the dataset."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    keys = dataset_keys(cls)
    for key in options:
        if key not in keys:
            allowed = ", ".join(f"data.{k}" for k in keys) or "none besides the common ones"
            raise ConfigError(
                f"data.{key} is not read by data.name={cls.name}"
                f"{did_you_mean(key, keys)}; its own keys: {allowed}"
            )
    if cls.config_class is None:
        return None
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cls.config_class), options)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or getattr(exc, "key", None) or "?"
        message = str(exc).strip().splitlines()[0]
        raise ConfigError(f"data.{key} (dataset {cls.name}): {message}") from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"data (dataset {cls.name}): {exc}") from None


def build_dataset_plugin(data: dict[str, Any], installed: dict[str, Any] | None = None) -> DatasetPlugin:
    """The plugin ``data['name']`` names, built with its own keys of the ``data`` section.

    Keys of the engine's DataConfig that this plugin does not read (e.g. ``root`` for
    synthetic) are left out: they have defaults, and a changed one is warned about.
    """
    from slipstream.config.schema import DataConfig

    cls = dataset_class(str(data.get("name")), installed)
    engine_keys = {f.name for f in dataclasses.fields(DataConfig)}
    own = set(dataset_keys(cls))
    options = {k: _home(v) for k, v in data.items() if k in own or k not in engine_keys}
    return cls(dataset_config(cls, options))


def _home(value: Any) -> Any:
    """``~`` at the start of a path (or of each of a list of them) is the home folder, as
    a shell would make it: quoted, as docs/data.md writes a brace pattern, it reaches us
    as written."""
    if isinstance(value, str) and value.startswith("~"):
        return os.path.expanduser(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_home(v) for v in value)
    return value
