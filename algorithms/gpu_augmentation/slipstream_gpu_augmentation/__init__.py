"""Batch augmentation on the run's device with kornia.

A per-sample transform in the DataLoader runs image by image on the host; kornia
augments the whole batch at once where the batch already is (the GPU, when there
is one), with random parameters drawn per sample on that device too. The plugin
augments training batches at ``batch_start``, after an image-size curriculum has
shrunk them (fewer pixels to warp). Batches arrive ``uint8`` (or float in [0, 1]
from a float loader) and leave float in [0, 1]; the engine normalises them and
sets their memory format afterwards.

Two more stages reproduce timm's training recipes: ``rand_augment`` (timm's string,
``rand-m9-mstd0.5-inc1``; :mod:`.randaugment`) after the kornia pipeline, and
``erasing`` (timm's RandomErasing; :mod:`.erasing`) at ``before_forward``, on the
normalised batch as timm erases normalised tensors. Both draw from their own stream
of the batch's seed with explicit generators.

Reproducibility: kornia 0.9 draws its parameters from ``torch.distributions``,
which use the global RNG and take no ``torch.Generator``. So each batch is
augmented inside ``torch.random.fork_rng`` with the global generators seeded from
``(run seed, rank, batch index)``: the same seed gives the same augmented batches,
the global RNG stream (dropout, the sampler) is left exactly as it was, and a
resumed run continues the same stream with no state to checkpoint.
"""

from __future__ import annotations

import difflib
import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import kornia.augmentation as K
import kornia.augmentation.auto as KA
import torch
from torch import nn

from slipstream import Algorithm, State, batch_seed, check_plugin_options, hookimpl, plugin_option, to_unit_float

from .erasing import Erasing, random_erase
from .randaugment import INTERPOLATIONS, RandAugmentSpec, parse_rand_augment, rand_augment

__all__ = [
    "AUGMENTATIONS", "PRESETS", "Erasing", "GpuAugmentation", "GpuAugmentationConfig",
    "RandAugmentSpec", "augment_batch", "batch_seed", "build_augmentation", "intra_op_threads",
    "moved_tensors", "parse_rand_augment", "place_pipeline", "rand_augment", "random_erase",
]  # fmt: skip

# none: no kornia stage, for rand_augment or erasing alone (the loader already crops).
PRESETS = ("light", "trivial", "randaugment", "custom", "none")

# Classes that are not augmentations of an image in [0, 1]: the engine normalises
# after every batch_start plugin, and mixing augmentations would need the labels.
_NOT_ALLOWED = {
    "Normalize": "the engine normalises the batch itself, after every batch_start plugin",
    "Denormalize": "inputs here are in [0, 1], not normalised",
    **{
        name: "it mixes images and needs the labels, which this plugin does not change"
        for name in dir(K)
        if isinstance(getattr(K, name), type)
        and issubclass(getattr(K, name), K.MixAugmentationBaseV2)
    },
}


def _augmentation_classes() -> dict[str, type[nn.Module]]:
    """Every kornia 2D augmentation and auto-augment policy a recipe may name."""
    found: dict[str, type[nn.Module]] = {}
    for name in dir(K):
        obj = getattr(K, name)
        if (
            isinstance(obj, type)
            and issubclass(obj, K.AugmentationBase2D)
            and not name.endswith("Base2D")
            and name not in _NOT_ALLOWED
        ):
            found[name] = obj
    for name in ("AutoAugment", "RandAugment", "TrivialAugment"):
        found[name] = getattr(KA, name)
    return found


AUGMENTATIONS = _augmentation_classes()


@dataclass
class GpuAugmentationConfig:
    preset: str = plugin_option("light", choices=PRESETS)
    # RandomResizedCrop area range (fraction of the image) for light/trivial/randaugment.
    crop_scale: list[float] = plugin_option(
        default_factory=lambda: [0.35, 1.0], low=0, high=1, low_open=True, items=True
    )
    # RandomHorizontalFlip probability for light/trivial/randaugment
    flip_p: float = plugin_option(0.5, low=0, high=1)
    randaugment_n: int = plugin_option(2, low=1, whole=True, note="operations per batch")
    randaugment_m: int = plugin_option(10, low=1, high=29, whole=True, note="kornia's magnitude scale")
    # preset=custom: [{name: RandomHorizontalFlip, p: 0.5}, {name: ColorJitter, brightness: 0.2}]
    custom: list[dict[str, Any]] = field(default_factory=list)
    # Intra-op threads while augmenting a batch that is on the CPU (0 = torch's setting).
    # 0 by default: changing torch's thread count and back can make the training step
    # that follows pay far more than kornia's small ops gain from one thread (a median
    # 15 % slower step in one measurement, none in two others: see the card).
    cpu_threads: int = plugin_option(0, low=0, whole=True, note="0 = torch's setting")
    # timm's RandAugment string, e.g. rand-m9-mstd0.5-inc1, applied after the preset
    # with each image's own operations and magnitudes (null = off).
    rand_augment: str | None = None
    # The colour rand_augment's geometric operations bring in, 0-255 as timm's
    # hparams img_mean (timm's train script passes the dataset's mean there).
    rand_augment_fill: list[float] = plugin_option(
        default_factory=lambda: [128.0, 128.0, 128.0], low=0, high=255, items=True
    )
    # How rand_augment's geometric operations resample: timm's default picks bilinear or
    # bicubic at random per application; its --train-interpolation fixes one.
    rand_augment_interpolation: str = plugin_option("random", choices=INTERPOLATIONS)
    # timm's RandomErasing at before_forward, on the normalised batch: {probability,
    # mode: const|rand|pixel, count: n or [min, max], min_area, max_area, min_aspect,
    # max_aspect}; {} = off.
    erasing: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_plugin_options(self)
        scale = list(self.crop_scale)
        if len(scale) != 2 or not scale[0] <= scale[1]:
            raise ValueError(f"crop_scale must be [min, max] with 0 < min <= max <= 1, got {scale}")
        if self.preset == "custom" and not self.custom:
            raise ValueError(
                "preset is 'custom' but custom is empty; list augmentations, e.g. "
                "custom: [{name: RandomHorizontalFlip, p: 0.5}]"
            )
        if self.custom and self.preset != "custom":
            raise ValueError(
                f"custom is set but preset is {self.preset!r}; set preset: custom to use it"
            )
        if self.rand_augment is not None:
            try:
                parse_rand_augment(self.rand_augment)
            except ValueError as exc:
                raise ValueError(f"rand_augment {exc}") from None
            if self.preset in ("trivial", "randaugment"):
                raise ValueError(
                    f"rand_augment and preset {self.preset!r} are two augmentation policies; "
                    "use preset light (crop and flip), none or custom with rand_augment"
                )
        if len(self.rand_augment_fill) not in (1, 3):
            raise ValueError(
                f"rand_augment_fill must be one value or three (0-255), got {list(self.rand_augment_fill)}"
            )
        Erasing.from_options(dict(self.erasing))  # raises naming the key
        if self.preset == "none" and self.rand_augment is None and not self.erasing:
            raise ValueError(
                "preset is 'none' and neither rand_augment nor erasing is set: the plugin would do "
                "nothing; set one of them, or another preset"
            )
        # Build (and, for custom entries, run once) now, so a bad recipe fails
        # before the run rather than at its first batch.
        for index, spec in enumerate(_specs(self)):
            where = f"custom[{index}]" if self.preset == "custom" else f"preset {self.preset!r}"
            _check_spec(where, spec, probe=self.preset == "custom")


def _specs(config: GpuAugmentationConfig) -> list[dict[str, Any]]:
    """The pipeline as a list of ``{name, **kwargs}``, presets included."""
    if config.preset == "custom":
        return [dict(spec) for spec in config.custom]
    if config.preset == "none":
        return []
    # Resample mode warps the whole batch in one call; slice mode loops over samples.
    crop = {
        "name": "RandomResizedCrop",
        "scale": tuple(config.crop_scale),
        "cropping_mode": "resample",
    }
    base = [crop, {"name": "RandomHorizontalFlip", "p": config.flip_p}]
    if config.preset == "trivial":
        return [*base, {"name": "TrivialAugment"}]
    if config.preset == "randaugment":
        return [
            *base,
            {"name": "RandAugment", "n": config.randaugment_n, "m": config.randaugment_m},
        ]
    return base


def _as_tuples(value: Any) -> Any:
    # YAML gives lists; kornia's range arguments expect tuples.
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def _close(word: str, choices: list[str]) -> list[str]:
    lowered = {c.lower(): c for c in choices}
    matches = difflib.get_close_matches(word.lower(), list(lowered), n=3, cutoff=0.5)
    return [lowered[m] for m in matches]


def _check_spec(where: str, spec: Any, probe: bool) -> None:
    """Raise ValueError naming the entry, the augmentation and the bad argument."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ValueError(
            f"{where} must be a mapping with a 'name', "
            f"e.g. {{name: RandomHorizontalFlip, p: 0.5}}, got {spec!r}"
        )
    name = spec["name"]
    if name in _NOT_ALLOWED:
        raise ValueError(f"{where}: {name} is not supported here: {_NOT_ALLOWED[name]}")
    if name not in AUGMENTATIONS:
        close = _close(name, list(AUGMENTATIONS))
        hint = (
            f"close matches: {', '.join(close)}"
            if close
            else f"available: {', '.join(sorted(AUGMENTATIONS))}"
        )
        raise ValueError(f"{where}: unknown kornia augmentation {name!r}; {hint}")
    cls = AUGMENTATIONS[name]
    kwargs = {k: v for k, v in spec.items() if k != "name"}
    params = inspect.signature(cls).parameters
    for arg in kwargs:
        if arg not in params:
            close = _close(arg, list(params))
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"{where} {name}: unknown argument {arg!r}{hint}; "
                f"{name} accepts {', '.join(params)}"
            )
    missing = [
        p
        for p, v in params.items()
        if v.default is inspect.Parameter.empty
        and p != "size"
        and p not in kwargs
        and v.kind not in (v.VAR_POSITIONAL, v.VAR_KEYWORD)
    ]
    if missing:
        raise ValueError(
            f"{where} {name}: missing required argument {', '.join(map(repr, missing))}"
        )
    try:
        stage = _stage(cls, kwargs)
        if probe:  # some arguments are only checked when the augmentation runs
            size = _as_tuples(kwargs.get("size", 16))
            h, w = size if isinstance(size, tuple) else (size, size)
            with _seeded(0, torch.device("cpu")):
                stage(torch.rand(2, 3, h, w))
    except Exception as exc:
        raise ValueError(
            f"{where} {name}: bad arguments {kwargs}: {type(exc).__name__}: {exc}"
        ) from None


class _FollowInputSize(nn.Module):
    """A kornia augmentation with a ``size`` argument (a crop), built for each input
    size so that its output keeps the input's shape whatever a curriculum does."""

    def __init__(self, cls: type[nn.Module], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.cls, self.kwargs = cls, kwargs
        self.by_size = nn.ModuleDict()
        self.cls(size=(16, 16), **kwargs)  # fail now on bad arguments, not at the first batch

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        h, w = inputs.shape[-2:]
        key = f"{h}x{w}"
        if key not in self.by_size:
            self.by_size[key] = place_pipeline(self.cls(size=(h, w), **self.kwargs), inputs.device)
        return self.by_size[key](inputs)

    def extra_repr(self) -> str:
        return f"{self.cls.__name__}(size=<input size>, {self.kwargs})"


def _stage(cls: type[nn.Module], kwargs: dict[str, Any]) -> nn.Module:
    kwargs = {k: _as_tuples(v) for k, v in kwargs.items()}
    if "size" in inspect.signature(cls).parameters and "size" not in kwargs:
        return _FollowInputSize(cls, kwargs)
    return cls(**kwargs)


def build_augmentation(config: GpuAugmentationConfig | None = None) -> nn.Module:
    """The kornia pipeline for ``config`` (defaults: the ``light`` preset).

    Takes and returns float batches ``(N, C, H, W)`` in [0, 1] of any size;
    crops resize back to the input's size. Built on the CPU; :func:`place_pipeline`
    moves it (and where its random parameters are drawn) to the batch's device.
    """
    config = config or GpuAugmentationConfig()
    stages = []
    for spec in _specs(config):
        kwargs = {k: v for k, v in spec.items() if k != "name"}
        stages.append(_stage(AUGMENTATIONS[spec["name"]], kwargs))
    return nn.Sequential(*stages)


# The range arguments of kornia's generators that they keep as given, numbers included,
# and only compute with: a crop's scale. Not its aspect ratio, whose bounds kornia reads
# on the host (``float(ratio.min())``): as a device tensor that costs two device
# synchronisations per batch, seen on an H100 (docs/results/2026-11-26-gpu-check-h100.md).
_RANGES = ("scale",)


def _numbers(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and bool(value) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
    )


def place_pipeline(pipeline: nn.Module, device: torch.device) -> nn.Module:
    """Move ``pipeline`` to ``device`` and have kornia draw its random parameters
    there, so that no parameter is copied from the host for each batch. Returns it."""
    pipeline.to(device)
    for module in pipeline.modules():
        if hasattr(module, "set_rng_device_and_dtype"):  # every kornia augmentation
            module.set_rng_device_and_dtype(device, torch.float32)
        generator = getattr(module, "_param_generator", None)
        if generator is not None:
            # kornia's generators take the device of their parameters from the ranges
            # they hold (kornia#4426): a range kept as a CPU tensor makes each batch's
            # random draws travel to the host and the crop matrices back. That holds
            # for tensors nested in a uniform generator's ``samplers`` too, (factor,
            # name, center, bound) entries (brightness and contrast in TrivialAugment:
            # a host round trip in 1 of 6 trivial batches on an H100).
            for attr, value in vars(generator).items():
                if attr in _RANGES and _numbers(value):
                    # A range kept as numbers becomes a new device tensor, copied from
                    # the host, at every batch: make it one once (on the CPU too, where
                    # it is merely cheaper, so that the CPU runs the device's path).
                    setattr(generator, attr, torch.tensor(value, dtype=torch.float32, device=device))
                elif (moved := moved_tensors(value, device)) is not value:
                    setattr(generator, attr, moved)
    return pipeline


def moved_tensors(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it, nested in tuples and lists, on ``device``;
    ``value`` itself when none needed moving."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if type(value) in (tuple, list):
        moved = [moved_tensors(v, device) for v in value]
        if all(new is old for new, old in zip(moved, value, strict=True)):
            return value
        return type(value)(moved)
    return value


@contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run with the global RNGs (CPU, and the batch's CUDA device) seeded to ``seed``,
    restoring them afterwards."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.random.default_generator.manual_seed(seed)
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield


@contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """Run with ``torch.set_num_threads(threads)`` (0: unchanged), restoring it after."""
    previous = torch.get_num_threads()
    if threads <= 0 or threads == previous:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def augment_batch(
    inputs: torch.Tensor, pipeline: nn.Module, seed: int | None = None
) -> torch.Tensor:
    """Augment an image batch with ``pipeline`` (from :func:`build_augmentation`,
    placed on the batch's device with :func:`place_pipeline`).

    ``inputs`` is ``uint8`` (0-255) or float in [0, 1]. Parameters are random per
    sample. With ``seed``, the result depends on the seed alone and the global RNG
    is left untouched (kornia takes no ``torch.Generator``, so this forks the
    global one); without it, the global RNG is used and advanced. The result has
    the input's shape, is float in [0, 1]; ``inputs`` is not modified.
    """
    inputs = to_unit_float(inputs)
    # A range given as numbers (a crop's scale) makes a kornia generator draw on the
    # default device: make that the batch's, or every draw is copied to the host.
    on_device = torch.device(inputs.device) if inputs.device.type != "cpu" else nullcontext()
    with on_device, _seeded(seed, inputs.device) if seed is not None else nullcontext():
        out = pipeline(inputs)
    if out.shape != inputs.shape:
        raise ValueError(
            f"the augmentation changed the batch shape from {tuple(inputs.shape)} "
            f"to {tuple(out.shape)}; "
            "leave out `size` so crops follow the input size"
        )
    # Some intensity operations (noise, brightness) may leave [0, 1]. In place, unless
    # an augmentation that skipped the batch handed back the input itself.
    out = out.to(inputs.dtype)
    if out.untyped_storage().data_ptr() == inputs.untyped_storage().data_ptr():
        return out.clamp(0, 1)
    return out.clamp_(0, 1)


class GpuAugmentation(Algorithm):
    """Augment training batches on the device: kornia (crop, flip, TrivialAugment, ...),
    timm's RandAugment per image and timm's random erasing."""

    name = "gpu_augmentation"
    config_class = GpuAugmentationConfig
    # Augment the already-resized (smaller, cheaper) batch.
    runs_after = ("image_size_curriculum",)
    # erasing replaces the batch at before_forward, where torch_compile marks the batch's
    # size dynamic: the mark must go on the tensor the model receives.
    runs_before = ("torch_compile",)

    def __init__(self, config: GpuAugmentationConfig | None = None) -> None:
        super().__init__(config)
        self.pipeline = build_augmentation(self.config)
        self._kornia = bool(_specs(self.config))  # preset none: no kornia stage
        self._device = torch.device("cpu")
        text = self.config.rand_augment
        self.rand_augment: RandAugmentSpec | None = parse_rand_augment(text) if text is not None else None
        erasing = Erasing.from_options(dict(self.config.erasing)) if self.config.erasing else None
        # Probability 0 erases nothing: skip the stage (and its copy of the batch).
        self.erasing = erasing if erasing is not None and erasing.probability > 0 else None

    @hookimpl
    def init(self, state: State) -> None:
        data = (state.config or {}).get("data") or {}
        crops = any(spec.get("name") == "RandomResizedCrop" for spec in _specs(self.config))
        if crops and data.get("train_crop") == "random_resized":
            warnings.warn(
                "slipstream: gpu_augmentation crops batches the loader has already cropped at random "
                "(data.train_crop=random_resized): each image is cropped twice; set data.train_crop=center "
                "and data.hflip=0 to crop only on the device, or use preset: none or custom without "
                "RandomResizedCrop",
                stacklevel=2,
            )

    @hookimpl
    def batch_start(self, state: State) -> None:
        # Training batches only: evaluation fires eval_batch_start, which this plugin leaves alone.
        inputs, *rest = state.batch
        threads = self.config.cpu_threads if inputs.device.type == "cpu" else 0
        with intra_op_threads(threads):
            if self._kornia:
                if inputs.device != self._device:
                    self._device = inputs.device
                    place_pipeline(self.pipeline, inputs.device)
                seed = batch_seed(state.seed, state.rank, state.timestamp.batch)
                inputs = augment_batch(inputs, self.pipeline, seed)
            if self.rand_augment is not None:
                # Its own stream of the batch's seed: turning it on leaves the kornia draws as they were.
                seed = batch_seed(state.seed, state.rank, state.timestamp.batch, "rand_augment")
                inputs = rand_augment(
                    to_unit_float(inputs),
                    self.rand_augment,
                    seed,
                    self.config.rand_augment_fill,
                    self.config.rand_augment_interpolation,
                )
        state.batch = (inputs, *rest)

    @hookimpl
    def before_forward(self, state: State) -> None:
        # timm erases normalised tensors (zeros are the mean colour, the noise is in units
        # of the std): the engine has normalised the batch by now.
        if self.erasing is None:
            return
        inputs, *rest = state.batch
        seed = batch_seed(state.seed, state.rank, state.timestamp.batch, "erasing")
        state.batch = (random_erase(inputs, self.erasing, seed), *rest)
