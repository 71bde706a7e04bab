"""The run-level settings, defined once and validated once.

:class:`TrainerOptions` declares every setting the Trainer takes (its default, what it
is, the type of its YAML value); the config's ``trainer`` section
(:func:`config_dataclass`) and the Trainer's keywords follow from it. The CLI's
config builds the options from ``cfg.trainer`` and a Trainer made in Python from its
keywords; either way :meth:`TrainerOptions.validate` checks them once, and
:mod:`slipstream.run.process` applies them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional, Union

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from slipstream.duration import Duration, DurationError
from slipstream.errors import ConfigError, did_you_mean

# Free-form keyword mappings of the config (a model's, optimizer's or loss's constructor
# arguments): a recipe or override gives one whole (`{}` replaces an inherited one), and
# a resume compares one whole (`{}` against a keyword is a change, not a key of another
# version of Slipstream).
KEYWORD_MAPPINGS = ("model.kwargs", "optimizer.kwargs", "loss.kwargs")

# `normalize="auto"`: the statistics of a dataset Slipstream knows, else none.
AUTO = "auto"
# Integers handed to torch must fit its 64-bit ints; Python's would overflow inside
# torch with a traceback.
INT64 = (-(2**63), 2**63 - 1)

NormalizeOption = Union[str, tuple[Sequence[float], Sequence[float]], None]


# The dtypes by the names configs use (peak_tflops, plugins' dtype options).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The peaks peak_tflops may name: the dtypes, and tf32 (fp32 tensors computed on CUDA's
# TF32 tensor cores, which cuDNN convolutions use by default).
PEAK_NAMES = (*DTYPES, "tf32")


# -- validators of trainer keys that the engine's services act on ---------------------


# The default metrics best_metric may name, and whether higher is better; any other
# evaluated metric may be named too (its plugin's higher_is_better says the direction).
BEST_METRICS = {"accuracy": True, "accuracy_top5": True, "loss": False}


def check_best_metric(value: str | None) -> str | None:
    """``value`` if it may be a ``trainer.best_metric`` (a metric's name, or null: no
    best.pt), else a ConfigError; whether the run evaluates it is the metrics' check
    (:func:`slipstream.plugins.metric.check_monitored`)."""
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(
            f"trainer.best_metric must name an evaluated metric ({', '.join(BEST_METRICS)}, or another of "
            f"evaluation.metrics) or be null for no best.pt, got {value!r}"
        )
    return value


ON_NONFINITE = ("stop", "warn")


def check_on_nonfinite(value: str) -> str:
    """``value`` if it is a valid ``trainer.on_nonfinite``, else a ConfigError."""
    if value not in ON_NONFINITE:
        raise ConfigError(
            f"trainer.on_nonfinite must be one of {', '.join(ON_NONFINITE)}, got {value!r}"
        )
    return value


def check_target(
    target_accuracy: Any, stop_at_target: Any, prefix: str = "trainer.", target_metric: Any = "accuracy"
) -> float | None:
    """Validate ``target_accuracy`` / ``stop_at_target`` / ``target_metric``; returns the
    target as a float (None when not set). The target is a fraction in (0, 1], or for
    ``loss`` (reached at or below it) any positive number; whether the run evaluates
    ``target_metric`` is the metrics' check."""
    if not isinstance(stop_at_target, bool):
        raise ConfigError(f"{prefix}stop_at_target must be true or false, got {stop_at_target!r}")
    if not isinstance(target_metric, str) or not target_metric or target_metric.endswith("/"):
        raise ConfigError(
            f"{prefix}target_metric must name an evaluated metric (accuracy, map, f1_macro, ...) "
            f"or SET/METRIC (val_v2/accuracy), got {target_metric!r}"
        )
    if target_accuracy is None:
        if stop_at_target:
            raise ConfigError(
                f"{prefix}stop_at_target needs {prefix}target_accuracy, e.g. {prefix}target_accuracy=0.9"
            )
        return None
    number = isinstance(target_accuracy, (int, float)) and not isinstance(target_accuracy, bool)
    unbounded = target_metric.rpartition("/")[2] == "loss"
    if number and unbounded and 0 < target_accuracy < math.inf:
        return float(target_accuracy)
    if not number or not 0 < target_accuracy <= 1:
        raise ConfigError(
            f"{prefix}target_accuracy must be a fraction in (0, 1] (0.9 for 90 %"
            f"{'' if target_metric == 'accuracy' else f' {target_metric}'}), got {target_accuracy!r}"
        )
    return float(target_accuracy)


def parse_peak_tflops(value: Any, source: str = "trainer.peak_tflops") -> dict[str, float] | None:
    """A ``peak_tflops`` setting as FLOP/s per dtype name (``"*"`` for a single number
    that holds for every dtype); None stays None (probe)."""
    if value is None:
        return None
    allowed = ", ".join(PEAK_NAMES)
    if isinstance(value, dict):
        items = dict(value)
        if not items:
            raise ConfigError(f"{source} is empty; give a number or a value for some of {allowed}")
    elif _positive(value):
        items = {"*": value}
    else:
        raise ConfigError(
            f"{source} must be a positive number of TFLOP/s or a mapping of {allowed} to "
            f"positive numbers, got {value!r}"
        )
    parsed = {}
    for name, tflops in items.items():
        if name != "*" and name not in PEAK_NAMES:
            raise ConfigError(f"{source}: unknown dtype {name!r}; allowed: {allowed}")
        if not _positive(tflops):
            raise ConfigError(f"{source}.{name} must be a positive number of TFLOP/s, got {tflops!r}")
        parsed[name] = float(tflops) * 1e12
    return parsed


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0



_SAME = object()  # a setting whose config type is its Python type


def setting(default: Any, help: str, *, config: Any = _SAME, api_only: bool = False) -> Any:
    """One trainer setting: its default, what it is (``help``), the type its config key
    has when the Python type is wider (``str | Duration`` is a ``str`` in YAML), and
    ``api_only`` for a keyword with no config key."""
    return dataclasses.field(
        default=default, metadata={"help": help, "config": config, "api_only": api_only}
    )


def config_dataclass(options: type, name: str) -> type:
    """The config section of a settings dataclass (:class:`TrainerOptions`): its
    fields less the Python-only ones, each with the type its YAML value has, so that
    omegaconf checks the types and the defaults are the Python API's."""
    hints = typing.get_type_hints(options)
    fields = []
    for f in dataclasses.fields(options):
        if f.metadata.get("api_only"):
            continue
        kind = f.metadata.get("config", hints[f.name])
        kind = hints[f.name] if kind is _SAME else kind
        if dataclasses.is_dataclass(kind):
            spec = field(default_factory=kind)
        elif isinstance(f.default, (list, tuple)):
            spec = field(default_factory=functools.partial(list, f.default))
        else:
            spec = field(default=f.default)
        fields.append((f.name, kind, spec))
    schema = dataclasses.make_dataclass(name, fields)
    schema.__module__ = options.__module__
    return schema


@dataclass
class DDPConfig:
    """``trainer.ddp``: options of DistributedDataParallel, the default wrap of a run of
    several processes."""

    bucket_cap_mb: Optional[float] = setting(None, "megabytes of gradients per all-reduce bucket (null: torch's 25)")
    static_graph: bool = setting(False, "true when the model uses the same parameters every step")
    find_unused_parameters: bool = setting(False, "true when some parameters get no gradient in a step")


SCHEDULER_INTERVALS = ("epoch", "batch")


@dataclass
class TrainerOptions:
    """Every run-level setting of a :class:`~slipstream.Trainer`: the one definition
    from which the config's ``trainer`` section (:func:`config_schema`) and the
    Trainer's keywords follow, each checked in :meth:`validate`.

    ``eval_interval=None`` turns evaluation off entirely (no final evaluation
    either); ``checkpoint_interval=None`` writes no checkpoint at all.
    ``normalize="auto"`` uses the mean/std of a dataset Slipstream knows
    (synthetic, CIFAR-10/100, ImageFolder) unless the dataset's own transform
    normalises (a torchvision ``Normalize`` in it), ``(mean, std)`` gives them,
    ``None`` leaves inputs as they come.
    """

    max_duration: str | Duration = setting("2ep", "how long the run trains", config=str)
    seed: int = setting(0, "seeds Python, NumPy and torch")
    eval_interval: str | Duration | None = setting(
        "1ep", "a duration; null: no evaluation at all", config=Optional[str]
    )
    device: str | torch.device | None = setting("auto", "auto | cpu | cuda | cuda:N", config=str)
    run_dir: str | Path | None = setting(
        None, "null: runs/<recipe>-<date>-<time>", config=Optional[str]
    )
    log_interval: int = setting(20, "batches between train records (the only device syncs)")
    checkpoint_interval: str | Duration | None = setting(
        "1ep", "a duration; null: no checkpoints at all", config=Optional[str]
    )
    checkpoint_keep: int = setting(
        2, "interval checkpoints kept besides latest.pt; 0 writes only latest.pt; -1 keeps all"
    )
    # The N best interval checkpoints by best_metric are kept too: what `slipstream
    # average --best N` averages (`--last N` needs checkpoint_keep >= N).
    keep_best: int = setting(
        0, "interval checkpoints also kept for being the best by best_metric (slipstream average --best)"
    )
    load_path: str | Path | None = setting(None, "a checkpoint to resume from", config=Optional[str])
    # A requeued job: continue from run_dir's latest.pt when it has one, else start
    # (from load_path when given); refused when the saved config differs in training.
    autoresume: bool = setting(False, "continue the run in run_dir from its latest.pt if any")
    # Fine-tuning: load_path gives the weights only (no optimizer, schedules, counters),
    # without the parameters matching load_ignore_keys (globs), from load_weights
    # ("model", or weights a plugin keeps in the checkpoint, e.g. "ema").
    load_weights_only: bool = setting(False, "load_path gives the model weights only")
    load_ignore_keys: Sequence[str] = setting((), "globs of weights not loaded", config=list[str])
    load_weights: str = setting("model", "model | a plugin's weights in the checkpoint, e.g. ema")
    overwrite: bool = setting(False, "clear the run files of a run_dir that already holds a run")
    on_nonfinite: str = setting("stop", "stop | warn: what a NaN or infinite training loss does")
    best_metric: str | None = setting(
        "accuracy", "an evaluated metric (accuracy, loss, f1_macro, ...) | null: what best.pt keeps"
    )
    progress_bar: bool = setting(True, "the tqdm bar")
    threads: int | None = setting(None, "torch.set_num_threads; null: torch's default")
    deterministic: bool = setting(False, "torch.use_deterministic_algorithms")
    target_accuracy: float | None = setting(None, "in (0, 1]: records time_to_target_s")
    # Which metric target_accuracy is read from: another set's (val_v2/accuracy), or a
    # multi-label run's map. One that improves downwards (loss) is reached at or below it.
    target_metric: str = setting("accuracy", "the metric target_accuracy is read from, or SET/METRIC")
    stop_at_target: bool = setting(False, "end the run at target_accuracy (status target_reached)")
    # A number, or {fp32: .., bf16: .., fp16: ..}; None: probed once per machine and cached.
    peak_tflops: float | Mapping[str, float] | None = setting(
        None, "the device's peak TFLOP/s for MFU", config=Optional[Any]
    )
    ddp: Mapping[str, Any] | None = setting(
        None, "DistributedDataParallel options (several processes only)", config=DDPConfig
    )
    # Measured auto (slipstream.plugins.variants): the variants plugins declare (bf16 or fp32,
    # NHWC or NCHW) are timed at fit start, or taken from the cache; false: each
    # plugin's fallback, unmeasured.
    autotune: bool = setting(True, "measure the plugins' auto variants at fit start")
    autotune_warmup: int = setting(1, "untimed training steps per combination")
    autotune_steps: int = setting(2, "timed training steps per combination (the fastest counts)")
    normalize: NormalizeOption = setting(
        AUTO, "auto | (mean, std) | None: inputs normalised on the device", api_only=True
    )
    verbose: bool = setting(True, "print notes and choices to stderr", api_only=True)
    # The loop steps a Trainer's torch LR schedulers (its schedulers=) at each epoch's end
    # or after each optimizer step; a config schedules the LR with stepwise_lr instead.
    scheduler_interval: str = setting("epoch", "epoch | batch: when schedulers= are stepped", api_only=True)
    # Set by validate(): the command line's options come validated by its config, and a
    # Trainer given them does not check them again.
    validated: ClassVar[bool] = False

    @classmethod
    def from_config(cls, trainer: Mapping[str, Any], **extra: Any) -> TrainerOptions:
        """The options in a config's ``trainer`` section (keys it does not name keep
        their defaults), with ``extra`` on top."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: plain(v) for k, v in trainer.items() if k in names}
        return cls(**{**values, **extra})

    @classmethod
    def from_keywords(cls, settings: Mapping[str, Any], source: str = "Trainer") -> TrainerOptions:
        """The options a caller passed as keywords; a name that is not a setting is a
        ConfigError naming the closest one (a misspelling would otherwise be a bare
        TypeError, or worse, ignored)."""
        names = [f.name for f in dataclasses.fields(cls)]
        for name in settings:
            if name not in names:
                raise ConfigError(
                    f"{source}: unknown setting {name!r}{did_you_mean(name, names)}; "
                    f"the settings are {', '.join(names)}"
                )
        return cls(**settings)

    def validate(self, prefix: str = "") -> TrainerOptions:
        """Refuse what torch or the loop would fail on later, naming the option
        (``prefix`` is ``"trainer."`` for a config) and what is allowed. Returns self."""
        max_duration = _duration(self.max_duration, f"{prefix}max_duration")
        if max_duration is None:
            raise ConfigError(f"{prefix}max_duration is required, e.g. '10ep'")
        if max_duration.unit == "dur":
            raise ConfigError(
                f"{prefix}max_duration: 'dur' is relative to the run itself; "
                "use ep, ba, sp or a wall-clock time"
            )
        _duration(self.eval_interval, f"{prefix}eval_interval")
        _duration(self.checkpoint_interval, f"{prefix}checkpoint_interval")
        _integer(self.log_interval, f"{prefix}log_interval", 1, "a number of batches")
        _integer(self.checkpoint_keep, f"{prefix}checkpoint_keep", -1, "-1 keeps all")
        _integer(self.keep_best, f"{prefix}keep_best", 0, "0 keeps none for their metric")
        if self.keep_best and self.best_metric is None and self.checkpoint_interval is not None:
            raise ConfigError(
                f"{prefix}keep_best={self.keep_best} keeps the best checkpoints by {prefix}best_metric, "
                "which is null; set best_metric (accuracy, accuracy_top5 or loss) or keep_best=0"
            )
        _integer(self.seed, f"{prefix}seed", INT64[0], "a 64-bit seed", high=INT64[1])
        if self.threads is not None:
            _integer(self.threads, f"{prefix}threads", 1, "null for torch's default")
        check_device(self.device, f"{prefix}device")
        _check_normalize(self.normalize, f"{prefix}normalize")
        check_on_nonfinite(self.on_nonfinite)
        check_best_metric(self.best_metric)
        self.ddp = check_ddp_options(self.ddp, f"{prefix}ddp")
        self.target_accuracy = check_target(self.target_accuracy, self.stop_at_target, prefix, self.target_metric)
        parse_peak_tflops(self.peak_tflops, f"{prefix}peak_tflops")
        if not isinstance(self.autotune, bool):
            raise ConfigError(f"{prefix}autotune must be true or false, got {self.autotune!r}")
        _integer(self.autotune_warmup, f"{prefix}autotune_warmup", 0, "untimed steps per combination")
        _integer(self.autotune_steps, f"{prefix}autotune_steps", 1, "timed steps per combination")
        if self.run_dir is not None:
            check_output_dir(Path(self.run_dir), f"{prefix}run_dir")
        if self.scheduler_interval not in SCHEDULER_INTERVALS:
            raise ConfigError(
                f"Trainer: scheduler_interval must be one of {', '.join(SCHEDULER_INTERVALS)}, "
                f"got {self.scheduler_interval!r}"
            )
        self._check_loading(prefix)
        self.validated = True
        return self

    def _check_loading(self, prefix: str) -> None:
        if self.autoresume and self.run_dir is None:
            raise ConfigError(
                f"{prefix}autoresume needs a fixed {prefix}run_dir (the directory a requeued "
                "job continues in), e.g. trainer.run_dir=runs/my-run"
            )
        if self.autoresume and self.checkpoint_interval is None:
            # Without checkpoints a requeued job has nothing to continue from: each
            # attempt would clear the last one's metrics and train again from step 0.
            raise ConfigError(
                f"{prefix}autoresume continues from the run's checkpoints, but "
                f"{prefix}checkpoint_interval is null (none are written); set one, e.g. "
                f"{prefix}checkpoint_interval=1ep"
            )
        if self.autoresume and self.overwrite:
            raise ConfigError(
                f"{prefix}autoresume and {prefix}overwrite contradict each other (continue the "
                "run, or delete it); drop one"
            )
        keys = self.load_ignore_keys
        if isinstance(keys, str) or not all(isinstance(k, str) and k for k in keys or ()):
            raise ConfigError(
                f"{prefix}load_ignore_keys must be a list of glob patterns of weight names, "
                f"e.g. ['head.*'], got {keys!r}"
            )
        self.load_ignore_keys = tuple(keys or ())
        if not isinstance(self.load_weights, str) or not self.load_weights:
            raise ConfigError(
                f"{prefix}load_weights must be 'model' or the weights a plugin keeps (e.g. 'ema'), "
                f"got {self.load_weights!r}"
            )
        fine_tuning = [
            name
            for name, on in (
                ("load_weights_only", self.load_weights_only),
                ("load_ignore_keys", bool(self.load_ignore_keys)),
                ("load_weights", self.load_weights != "model"),
            )
            if on
        ]
        if fine_tuning and self.load_path is None:
            raise ConfigError(
                f"{prefix}{fine_tuning[0]} says how to load {prefix}load_path, which is not set"
            )
        partial = [n for n in fine_tuning if n != "load_weights_only"]
        if partial and not self.load_weights_only:
            raise ConfigError(
                f"{prefix}{partial[0]} loads part of a checkpoint: it goes with "
                f"{prefix}load_weights_only=true (a resume restores everything)"
            )

    def as_config(self) -> dict[str, Any]:
        """The options as a plain, YAML-safe ``trainer`` section."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (Duration, Path, torch.device)):
                value = str(value)
            elif isinstance(value, tuple) and f.name == "normalize":
                value = [list(map(float, part)) for part in value]
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, Mapping):
                value = dict(value)
            out[f.name] = value
        return out


DDP_OPTIONS = {f.name: f.metadata["help"] for f in dataclasses.fields(DDPConfig)}


def plain(value: Any) -> Any:
    """A config's value as plain Python: omegaconf's containers and any mapping as
    dicts with string keys, sequences as lists, recursively."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def check_ddp_options(options: Mapping[str, Any] | None, key: str = "ddp") -> dict[str, Any]:
    """The ``DistributedDataParallel`` keywords in ``options`` (keys of
    :data:`DDP_OPTIONS`; a None value leaves torch's default), checked."""
    out: dict[str, Any] = {}
    for name, value in dict(options or {}).items():
        if name not in DDP_OPTIONS:
            allowed = ", ".join(f"{k} ({v})" for k, v in DDP_OPTIONS.items())
            raise ConfigError(f"{key}.{name} is not a DDP option; allowed: {allowed}")
        if value is None:
            continue
        if name == "bucket_cap_mb":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{key}.bucket_cap_mb must be a number of megabytes > 0, got {value!r}")
        elif not isinstance(value, bool):
            raise ConfigError(f"{key}.{name} must be true or false, got {value!r}")
        out[name] = value
    return out


def _duration(value: Any, key: str) -> Duration | None:
    if value is None:
        return None
    try:
        duration = Duration.parse(value)
    except DurationError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    if duration.value <= 0:
        raise ConfigError(f"{key}: must be positive, got {value!r} (null turns it off)")
    return duration


def _integer(value: Any, key: str, low: int, allowed: str, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} must be a whole number ({allowed}), got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise ConfigError(f"{key} must be {bound} ({allowed}), got {value}")


def check_device(device: Any, key: str = "device") -> None:
    """A device string torch accepts and this machine has."""
    if device is None or device == "auto" or isinstance(device, torch.device):
        parsed = device if isinstance(device, torch.device) else None
    else:
        allowed = "auto, cpu, cuda or cuda:N (N a GPU index)"
        if not isinstance(device, str):
            raise ConfigError(f"{key} must be a device name ({allowed}), got {device!r}")
        try:
            parsed = torch.device(device)
        except RuntimeError:
            raise ConfigError(f"{key}={device!r} is not a device; use {allowed}") from None
    if parsed is None or parsed.type == "cpu":
        return
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{key}={str(device)!r} but CUDA is not available here; use 'cpu' or 'auto'"
            )
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise ConfigError(
                f"{key}={str(device)!r} but this machine has {count} GPU(s): "
                f"use cuda:0 to cuda:{count - 1}"
            )
        return
    if parsed.type == "mps" and torch.backends.mps.is_available():
        return
    raise ConfigError(
        f"{key}={str(device)!r}: Slipstream runs on CPU or CUDA; use auto, cpu, cuda or cuda:N"
    )


def _check_normalize(value: Any, key: str) -> None:
    if value is None or value == AUTO:
        return
    try:
        mean, std = value
        mean, std = [float(v) for v in mean], [float(v) for v in std]
    except (TypeError, ValueError):
        raise ConfigError(
            f"{key} must be 'auto', None or (mean, std) per channel, got {value!r}"
        ) from None
    if len(mean) != len(std) or not mean or min(std) <= 0:
        raise ConfigError(
            f"{key}: mean and std need one value per channel and a positive std, got {value!r}"
        )


def check_output_dir(path: Path, key: str) -> None:
    """Refuse a directory that cannot be created, before any work is done: an
    existing file in its place or above it, or an ancestor we may not write to."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}={path}: this is a file, not a directory; choose another path")
    ancestor = path
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(
            f"{key}={path}: cannot create it under {ancestor}, which is a file; choose another path"
        )
    if ancestor != path and not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{key}={path}: cannot create it in {ancestor} (no write permission or a "
            "read-only file system); choose another path"
        )


def dataset_stats(data: Any) -> tuple[Sequence[float], Sequence[float]] | None:
    """Mean/std for ``normalize='auto'``: known for the datasets the built-in sources
    build (:func:`slipstream.data.datasets.stats_of`); None otherwise."""
    from slipstream.data.datasets import stats_of

    return stats_of(getattr(data, "dataset", data))


def normalized_by_its_transform(data: Any) -> bool:
    """Whether the dataset behind ``data`` normalises its samples itself: a torchvision
    ``Normalize`` (v1 or v2) anywhere in its ``transform``, as in most CIFAR and
    ImageNet scripts. ``normalize='auto'`` then leaves the inputs as they come."""
    from torchvision import transforms
    from torchvision.transforms import v2

    dataset = getattr(data, "dataset", data)
    todo = [getattr(dataset, "transform", None), getattr(dataset, "transforms", None)]
    seen: set[int] = set()
    while todo:
        step = todo.pop()
        if step is None or id(step) in seen or len(seen) > 1000:
            continue
        seen.add(id(step))
        if isinstance(step, (transforms.Normalize, v2.Normalize)):
            return True
        inner = getattr(step, "transforms", None)  # Compose, RandomApply, RandomChoice
        if isinstance(inner, (list, tuple)):
            todo.extend(inner)
        todo.append(getattr(step, "transform", None))  # a dataset's StandardTransform
    return False


def resolve_normalize(
    normalize: NormalizeOption, train_data: Any
) -> tuple[tuple[Sequence[float], Sequence[float]] | None, str | None]:
    """(mean, std) or None, and a note to print when ``auto`` found no statistics."""
    if normalize != AUTO:
        return normalize, None  # type: ignore[return-value]
    if normalized_by_its_transform(train_data):
        return None, None  # the dataset's own transform normalises: twice would be wrong
    stats = dataset_stats(train_data)
    if stats is None:
        kind = type(getattr(train_data, "dataset", train_data)).__name__
        return None, (
            f"inputs are not normalised: no known mean/std for a {kind}; "
            "pass normalize=(mean, std), or normalize=None to say so"
        )
    return stats, None
