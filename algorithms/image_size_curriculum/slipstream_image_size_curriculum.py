"""Image-size curriculum (progressive resizing): train on small images first and grow
them to the dataset's own size, so that early epochs cost a fraction of the pixels.

Two schedule shapes:

* ``linear`` (default, Composer's progressive resizing): ``initial_scale`` of the full
  size for the first ``delay`` of the run, full size for the last ``finetune``, linear
  in between. Relative to the run's length, so it suits any run.
* ``stepped`` (Borealis' "ViT in 24 hours" recipe): ``initial_size`` px, plus
  ``increment`` px every ``every`` (``5ep``, ``1000ba``, ``0.1dur``), up to full size.

Evaluation batches are never touched: the model is always evaluated at full size.
Where the training images are cut from files (``in_loader``), the loader's workers cut
each batch at its size, instead of a full-size batch shrunk on the device.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from timm.layers import Format
from torch import nn

from slipstream import (
    Algorithm,
    ConfigError,
    Duration,
    State,
    batch_generator,
    check_plugin_options,
    hookimpl,
    parse_duration_option,
    plugin_option,
    to_unit_float,
)
from slipstream.data import output_size_of, set_output_size

SCHEDULES = ("linear", "stepped")
MODES = ("bilinear", "nearest", "random_crop")


@dataclass
class ImageSizeCurriculumConfig:
    schedule: str = plugin_option("linear", choices=SCHEDULES)
    # linear: fractions of the full size and of the run
    initial_scale: float = plugin_option(0.5, low=0, high=1, low_open=True)
    delay: float = plugin_option(0.4, low=0, high=1, note="a fraction of the run")
    finetune: float = plugin_option(0.2, low=0, high=1, note="a fraction of the run")
    # stepped: pixels and a duration
    initial_size: int = plugin_option(32, low=1, whole=True, note="pixels")
    increment: int = plugin_option(32, low=1, whole=True, note="pixels")
    every: str = "5ep"
    # sizes are rounded to a multiple of this; 0 or None = the model's patch size (1 for CNNs)
    size_multiple: Optional[int] = plugin_option(None, low=0, whole=True, note="0 or null = automatic")
    mode: str = plugin_option("bilinear", choices=MODES)
    antialias: bool = True
    # Tell the loader each batch's size, so its workers cut small crops instead of
    # full-size ones shrunk on the device (FFCV's progressive resizing): with the
    # bilinear mode, where the data can (images cut from files by a geometry); the
    # batches are resized on the device otherwise.
    in_loader: bool = True

    def __post_init__(self) -> None:
        check_plugin_options(self)
        if self.delay + self.finetune > 1:
            raise ValueError(
                f"delay + finetune must be at most 1 (they are fractions of one run), "
                f"got {self.delay} + {self.finetune}"
            )
        parse_duration_option(ImageSizeCurriculum.name, "every", self.every, positive=True)

    @property
    def time_unit(self) -> str:
        """The unit :func:`size_at` reads time in: ``dur`` for linear, ``every``'s for stepped."""
        return "dur" if self.schedule == "linear" else Duration.parse(self.every).unit


# ---------------------------------------------------------------------------
# Functional API
# ---------------------------------------------------------------------------


def _linear_scale(fraction: float, initial_scale: float, delay: float, finetune: float) -> float:
    ramp = 1.0 - delay - finetune
    if fraction < delay:
        return initial_scale
    if ramp <= 0 or fraction >= delay + ramp:
        return 1.0
    return initial_scale + (1.0 - initial_scale) * (fraction - delay) / ramp


def size_at(config: ImageSizeCurriculumConfig, t: float, full_size: int, multiple: int = 1) -> int:
    """The side length (px) to train at, at time ``t`` of the run.

    ``t`` is in ``config.time_unit``: the fraction of the run done (0 to 1) for the
    ``linear`` schedule; the time passed in ``every``'s unit for ``stepped`` (epochs
    when ``every='5ep'``). The size is rounded to the nearest ``multiple`` (a ViT's
    patch size), is never below one ``multiple`` and never above ``full_size``.

    >>> cfg = ImageSizeCurriculumConfig(schedule="stepped", initial_size=32, every="5ep")
    >>> [size_at(cfg, epoch, 224, 16) for epoch in (0, 4.9, 5, 12, 30, 40)]
    [32, 32, 64, 96, 224, 224]
    """
    if config.schedule == "linear":
        target = full_size * _linear_scale(t, config.initial_scale, config.delay, config.finetune)
    else:
        periods = math.floor(t / Duration.parse(config.every).value + 1e-9)
        target = config.initial_size + config.increment * periods
    if target >= full_size:
        return full_size
    rounded = multiple * max(1, int(target / multiple + 0.5))
    return min(rounded, full_size)


def resize_batch(
    inputs: torch.Tensor,
    size: int | tuple[int, int],
    mode: str = "bilinear",
    generator: torch.Generator | None = None,
    antialias: bool = True,
) -> torch.Tensor:
    """Resize a batch of images ``(N, C, H, W)`` to ``size`` where it is: on its own
    device, and in its own dtype where torch can.

    ``bilinear`` (antialiased by default, so a downscale averages rather than
    aliases), ``nearest``, or ``random_crop``: one crop of ``size`` at a random offset
    for the whole batch (drawn on the host from ``generator``: no device sync).
    ``uint8`` batches stay ``uint8`` (rounded to the nearest level: about 3x faster
    than float on CPU), except for ``bilinear`` off the CPU, where torch has no
    ``uint8`` kernel: those come back float in [0, 1]. Returns ``inputs`` itself
    when it already has that size.
    """
    h, w = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    height, width = inputs.shape[-2:]
    if (h, w) == (height, width):
        return inputs
    if mode == "random_crop":
        if h > height or w > width:
            raise ValueError(f"cannot crop {h}x{w} out of {height}x{width} images")
        top = int(torch.randint(0, height - h + 1, (1,), generator=generator))
        left = int(torch.randint(0, width - w + 1, (1,), generator=generator))
        return inputs[..., top : top + h, left : left + w]
    if mode == "nearest":
        # torch's "nearest" samples off-centre (a known legacy quirk); "nearest-exact" does not.
        return F.interpolate(inputs, size=(h, w), mode="nearest-exact")
    if mode == "bilinear":
        if inputs.device.type != "cpu":
            inputs = to_unit_float(inputs)
        return F.interpolate(inputs, size=(h, w), mode="bilinear", antialias=antialias, align_corners=False)
    raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")


def allow_any_input_size(model: nn.Module) -> tuple[int, int] | None:
    """Let a timm ViT take any input size, and return its patch size (None for a
    model without ``patch_embed``, such as a CNN).

    A timm VisionTransformer built without ``dynamic_img_size`` is switched to it in
    place: the patch embedding keeps the token grid (NHWC) and stops asserting the
    input size, and the position embedding is resampled on the fly. No parameter is
    replaced, so the optimizer, EMA copies and checkpoints keep their shapes. At the
    model's own size the outputs are unchanged.
    """
    embed = getattr(model, "patch_embed", None)
    if embed is None or not hasattr(embed, "patch_size"):
        return None
    if getattr(model, "dynamic_img_size", None) is False:
        model.dynamic_img_size = True
        embed.strict_img_size = False
        embed.flatten = False
        embed.output_fmt = Format.NHWC
    elif not hasattr(model, "dynamic_img_size") and getattr(embed, "strict_img_size", False):
        raise ConfigError(
            f"image_size_curriculum: {type(model).__name__} only takes its own input size "
            "(patch_embed.strict_img_size) and has no dynamic_img_size switch; use a model "
            "that accepts any input size (a timm VisionTransformer, a CNN)"
        )
    patch = embed.patch_size
    return (patch, patch) if isinstance(patch, int) else (int(patch[0]), int(patch[1]))


# ---------------------------------------------------------------------------
# The algorithm
# ---------------------------------------------------------------------------


class ImageSizeCurriculum(Algorithm):
    """Train on small images first and grow them to full size (progressive resizing)."""

    name = "image_size_curriculum"
    config_class = ImageSizeCurriculumConfig
    # Augment the resized (smaller) batch; compile the model after the ViT is switched
    # to dynamic sizes. (The memory format is the engine's, after every transform.)
    runs_before = ("gpu_augmentation", "torch_compile")

    def __init__(self, config: ImageSizeCurriculumConfig | None = None) -> None:
        super().__init__(config)
        self.multiple = (1, 1)
        self.size: tuple[int, int] | None = None  # the size of the last training batch
        self._checked_schedule = False
        self._loader = None  # the training loader that cuts at the told sizes (in_loader)
        self._full = 0  # its own size

    @hookimpl
    def init(self, state: State) -> None:
        model = state.unwrapped_model
        patch = allow_any_input_size(model)
        chosen = self.config.size_multiple
        pads = getattr(getattr(model, "patch_embed", None), "dynamic_img_pad", False)
        if chosen and patch is not None and not pads and (chosen % patch[0] or chosen % patch[1]):
            raise ConfigError(
                f"algorithms.image_size_curriculum.size_multiple={chosen} is not a multiple of the "
                f"model's patch size {patch[0]}; use 0 (automatic) or a multiple of it"
            )
        self.multiple = (chosen, chosen) if chosen else (patch or (1, 1))
        state.varying_input_size = True
        self._loader = None
        if self.loader_cuts(state.train_loader):
            self._loader, self._full = state.train_loader, int(output_size_of(state.train_loader))

    def loader_cuts(self, loader: object) -> bool:
        """Whether the loader will cut the images at the schedule's sizes: ``in_loader``
        on, the antialiased ``bilinear`` mode (the loader's resize is one too), square
        multiples, and a loader that can (:func:`slipstream.data.set_output_size`: images
        cut from files by a geometry). Told None here, so an earlier run's sizes go."""
        cfg = self.config
        wanted = cfg.in_loader and cfg.mode == "bilinear" and cfg.antialias and self.multiple[0] == self.multiple[1]
        return bool(wanted and output_size_of(loader) and set_output_size(loader, None))

    @hookimpl
    def epoch_start(self, state: State) -> None:
        if self._loader is None:
            return
        # Each batch's size, as batch_start will compute it, for the workers to cut at
        # (a resumed epoch gets the same list, so the same crops).
        sizes = [self._size_of_batch(state, b) for b in range(state.batches_per_epoch or 0)]
        set_output_size(self._loader, [0 if size >= self._full else size for size in sizes] or None)

    def _size_of_batch(self, state: State, batch: int) -> int:
        """The size for batch ``batch`` of the current epoch, with the time computed as
        ``state.time_in`` will compute it then (so the two agree to the last bit); the
        full size where that time is unknown now (a wall clock)."""
        unit, ts, per_epoch = self.config.time_unit, state.timestamp, state.batches_per_epoch
        total = state.max_duration

        def time_in(u: str) -> float | None:
            if u == "ep":
                return ts.epoch + batch / per_epoch
            if u == "ba":
                return float(ts.epoch * per_epoch + batch)
            if u == "sp" and state.global_batch_size:
                return float((ts.epoch * per_epoch + batch) * state.global_batch_size)
            return None

        if unit == "dur":
            now = time_in(total.unit)
            t = None if now is None else (min(1.0, now / total.value) if total.value > 0 else 1.0)
        else:
            t = time_in(unit)
        return self._full if t is None else size_at(self.config, t, self._full, self.multiple[0])

    @hookimpl
    def fit_end(self, state: State) -> None:
        if self._loader is not None:  # the loader cuts at its own size again, for whoever reads it next
            set_output_size(self._loader, None)

    @hookimpl
    def batch_start(self, state: State) -> None:
        inputs, *rest = state.batch
        shape = tuple(inputs.shape[-2:])
        # Where the loader cuts the sizes, the batch may be small already: the schedule
        # is relative to the loader's own size.
        full = (self._full, self._full) if self._loader is not None else shape
        if not self._checked_schedule:
            self._checked_schedule = True
            self._warn_if_full_size_is_late(state, max(full))
        t = state.time_in(self.config.time_unit)
        pairs = zip(full, self.multiple, strict=True)
        size = tuple(size_at(self.config, t, side, multiple) for side, multiple in pairs)
        self.size = size
        if size == shape:
            return  # full size, or cut at this size by the loader's workers
        generator = batch_generator(state) if self.config.mode == "random_crop" else None
        resized = resize_batch(inputs, size, self.config.mode, generator, self.config.antialias)
        state.batch = (resized, *rest)

    def _warn_if_full_size_is_late(self, state: State, full: int) -> None:
        cfg = self.config
        if cfg.schedule != "stepped" or cfg.initial_size >= full:
            return
        try:
            period = state.fraction_of_run(cfg.every)
        except ValueError:
            return  # not comparable with the run's length (e.g. wall clock in an epoch run)
        steps = math.ceil((full - cfg.initial_size) / cfg.increment)
        if steps * period >= 1 - 1e-9:  # full size from the last batch on is too late
            warnings.warn(
                f"image_size_curriculum: the stepped schedule reaches the full {full} px after "
                f"{steps} x {cfg.every}, at or past the end of this {state.max_duration} run; "
                "the run trains only at smaller sizes than evaluation uses",
                stacklevel=2,
            )

    def state_dict(self) -> dict[str, list[int]]:
        return {"size": list(self.size)} if self.size is not None else {}

    def load_state_dict(self, state: dict[str, list[int]]) -> None:
        if "size" in state:
            self.size = (int(state["size"][0]), int(state["size"][1]))
