"""Dataset plugins: entry-point group ``slipstream.datasets``, one per ``data.name``.

A dataset plugin is a class with a ``name``, an optional ``config_class`` dataclass
(its own ``data.<key>`` options, checked like an algorithm's) and a ``build`` method
that returns the train and eval data of one rank. The built-ins (synthetic, synthetic_multilabel,
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
from dataclasses import dataclass, field
from typing import Any, Optional

from slipstream.data.stats import BUILTIN_SUMMARIES, Stats  # noqa: F401 (re-exported)
from slipstream.errors import ConfigError, did_you_mean
from slipstream.plugins.dataset import DATASETS_GROUP, BuiltData, DataRequest, DatasetPlugin  # noqa: F401


@dataclass
class DataConfig:
    # An installed dataset plugin (`slipstream datasets`): synthetic | cifar10 | cifar100 |
    # imagefolder | webdataset | huggingface | a third party's. Keys a plugin declares
    # besides these (data.urls, data.path ...) are checked against its config_class.
    name: str = "synthetic"
    root: Optional[str] = None
    download: bool = False
    image_size: int = 32
    num_classes: int = 10  # synthetic only; real datasets say their own
    train_size: int = 5000  # synthetic
    val_size: int = 1000  # synthetic
    batch_size: int = 128  # per process
    eval_batch_size: Optional[int] = None  # None: 2 x batch_size
    num_workers: int = 0
    pin_memory: bool = True  # page-locked batches for non_blocking copies; CUDA only (runner)
    persistent_workers: bool = False
    drop_last: bool = True
    # Repeated augmentation (DeiT, timm's --aug-repeats): each sample this many times per
    # epoch, each copy cropped differently; the epoch keeps its length. 1: off.
    repeats: int = 1
    normalize: bool = True  # normalise on the device with the dataset's mean/std
    # The images' geometry (slipstream.data.geometry); null: the dataset's own default
    # (DatasetPlugin.photos: a random resized crop, flips and timm's 0.875 centre crop
    # for photos, the images as they are for data made at its size).
    train_crop: Optional[str] = None  # random_resized | center | none
    scale: list[float] = field(default_factory=lambda: [0.08, 1.0])  # random_resized: area fraction
    ratio: list[float] = field(default_factory=lambda: [0.75, 1.3333])  # random_resized: aspect ratio
    interpolation: str = "bilinear"  # bilinear | bicubic
    hflip: Optional[float] = None  # probability of a horizontal flip in training
    eval_image_size: Optional[int] = None  # null: image_size
    crop_pct: Optional[float] = None  # evaluation: the centre crop's fraction of the shorter side
    reduced_decoding: bool = True  # JPEG decoded at 1/2, 1/4 or 1/8 scale where the crop allows
    # Where JPEGs are decoded: cpu (the loader's workers) | gpu (nvJPEG, in batches on the
    # run's CUDA device; the workers read bytes and draw the crops) | auto (measured at
    # the start, docs/auto.md). slipstream.data.gpu_decode.
    decode: str = "cpu"
    # Several evaluation sets, evaluated side by side (docs/metrics.md): a mapping of a
    # name to the keys of this section that differ for that set ({val: {}, val_288:
    # {eval_image_size: 288}}); null: one set named val, this section's.
    eval_sets: Optional[dict[str, Any]] = None


# DataConfig's keys that only some dataset plugins read: those whose config_class
# declares the key, and for data.persistent_workers those that do not stream. They
# stay in DataConfig so that older recipes and command lines keep working.
READ_BY_SOME: tuple[str, ...] = ("num_classes", "train_size", "val_size", "root", "download", "persistent_workers")


def reads(cls: type[DatasetPlugin], key: str) -> bool:
    """Whether the dataset plugin ``cls`` reads ``data.<key>``, one of :data:`READ_BY_SOME`."""
    if key == "persistent_workers":
        return not cls.streams
    return key in dataset_keys(cls)


def readers(key: str) -> list[str]:
    """The installed dataset plugins that read ``data.<key>`` (imports them all)."""
    return [
        name for name, info in discover_datasets(load=True).items() if info.cls is not None and reads(info.cls, key)
    ]


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
    from slipstream.plugins.discovery import plugin_config

    keys = dataset_keys(cls)
    for key in options:
        if key not in keys:
            allowed = ", ".join(f"data.{k}" for k in keys) or "none besides the common ones"
            raise ConfigError(
                f"data.{key} is not read by data.name={cls.name}"
                f"{did_you_mean(key, keys)}; its own keys: {allowed}"
            )
    return plugin_config(cls, options, prefix="data", about=f" (dataset {cls.name})")


def build_dataset_plugin(data: dict[str, Any], installed: dict[str, Any] | None = None) -> DatasetPlugin:
    """The plugin ``data['name']`` names, built with its own keys of the ``data`` section.

    Keys of the engine's DataConfig that this plugin does not read (e.g. ``root`` for
    synthetic) are left out: they have defaults, and a changed one is warned about.
    """
    cls = dataset_class(str(data.get("name")), installed)
    engine_keys = {f.name for f in dataclasses.fields(DataConfig)}
    own = set(dataset_keys(cls))
    options = {k: _home(v) for k, v in data.items() if k in own or k not in engine_keys}
    return cls(dataset_config(cls, options))


def eval_set_configs(data: Any) -> dict[str, dict[str, Any]]:
    """Each evaluation set's dataset description, by name, in the config's order: the
    ``data`` section (a mapping) with the set's own keys over it; without
    ``data.eval_sets`` one set, ``val``, the section itself."""
    data = dict(_plain(data))
    sets = data.pop("eval_sets", None)
    if sets is None:
        return {"val": data}
    if not isinstance(sets, dict) or not sets:
        raise ConfigError(
            "data.eval_sets maps each evaluation set's name to the data keys it changes, e.g. "
            f"{{val: {{}}, val_288: {{eval_image_size: 288}}}}, or is null; got {sets!r}"
        )
    out = {}
    for name, own in sets.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ConfigError(
                f"data.eval_sets: a set's name is a word without '/' (SET/METRIC names its metrics), got {name!r}"
            )
        own = {} if own is None else own
        if not isinstance(own, dict) or "eval_sets" in own:
            raise ConfigError(
                f"data.eval_sets.{name} must be a mapping of data keys (name, root, eval_image_size, "
                f"crop_pct, ...), got {own!r}"
            )
        out[name] = {**data, **own}
    return out


def _plain(value: Any) -> Any:
    """An OmegaConf node as plain Python (dicts and lists), anything else as it is."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return value
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def _home(value: Any) -> Any:
    """``~`` at the start of a path (or of each of a list of them) is the home folder, as
    a shell would make it: quoted, as docs/data.md writes a brace pattern, it reaches us
    as written."""
    if isinstance(value, str) and value.startswith("~"):
        return os.path.expanduser(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_home(v) for v in value)
    return value
