"""What every source does to an image between its file and the batch: the training
crop (timm's and torchvision's ``RandomResizedCrop``, a centre crop, or none) and
flip, and the evaluation resize and centre crop (timm's ``crop_pct``).

An encoded image is cropped while it is decoded, in the loader's workers: the crop's
box is chosen on the whole image from its header (no pixels yet), a JPEG is decoded at
the smallest of libjpeg's 1/2, 1/4 and 1/8 scales that still holds the box at the
output size (Pillow's ``draft``: reduced-size decoding), and the box is resized to the
output in one step. EXIF orientation is applied; grey, palette, CMYK, alpha and 16-bit
images all come out as 3-channel uint8. Random choices are drawn from a generator
seeded by (run seed, epoch, sample, repeat), so the same sample gets the same crop in the same
epoch with any number of workers, and a resume is exact.
"""

from __future__ import annotations

import hashlib
import io
import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from slipstream.data.sampler import SampleKey, epoch_seed
from slipstream.errors import DataError

TRAIN_CROPS = ("random_resized", "center", "none")
INTERPOLATIONS = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC}
# EXIF orientation -> the transpose that makes the image upright.
_ORIENTATIONS = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_EXIF_ORIENTATION = 0x0112


@dataclass(frozen=True)
class Geometry:
    """How one split's images are cut to ``size`` x ``size``.

    ``crop``: ``random_resized`` (an area fraction in ``scale`` and an aspect ratio in
    ``ratio``, as torchvision draws them), ``center`` (the centre square whose side is
    ``crop_pct`` of the shorter side: timm's resize to ``size / crop_pct`` then centre
    crop, in one step), or ``none`` (the whole image resized to a square). ``hflip``:
    the probability of a horizontal flip. ``reduced_decoding``: JPEG draft decoding.
    """

    size: int
    crop: str = "center"
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    interpolation: str = "bilinear"
    hflip: float = 0.0
    crop_pct: float = 1.0
    reduced_decoding: bool = True
    seed: int = 0
    # data.decode=gpu or auto: while its ``on`` is set, a baseline RGB JPEG is not
    # decoded here but returned as its bytes and its crop (slipstream.data.gpu_decode),
    # for the main process to decode the batch on the GPU. Shared by a run's train and
    # eval geometries; None: always decoded here (data.decode=cpu).
    switch: Any = field(default=None, compare=False, repr=False)

    @property
    def random(self) -> bool:
        return self.crop == "random_resized" or self.hflip > 0

    def at(self, size: int) -> Geometry:
        """The same cut to another output ``size`` (a curriculum's smaller images)."""
        return self if size == self.size else replace(self, size=size)

    # -- the box -----------------------------------------------------------------------
    def box(self, width: int, height: int, rng: random.Random | None) -> tuple[float, float, float, float]:
        """(left, top, right, bottom) of the crop in an upright ``width`` x ``height`` image."""
        if self.crop == "random_resized":
            return _random_resized_box(width, height, self.scale, self.ratio, rng or random.Random(0))
        if self.crop == "none":
            return 0.0, 0.0, float(width), float(height)
        side = min(width, height) * self.crop_pct
        left, top = (width - side) / 2, (height - side) / 2
        return left, top, left + side, top + side

    def generator(self, key: Any) -> random.Random | None:
        """The sample's own generator (None where nothing is random): its seed mixes the
        run's seed, the epoch, the sample (a SampleKey, or :func:`sample_key` of a
        stream's sample name; a bare index is epoch 0) and, for a repeat after the first
        (``data.repeats``), the repeat's index."""
        if not self.random:
            return None
        seed = epoch_seed(epoch_seed(self.seed, getattr(key, "epoch", 0)), int(key))
        repeat = getattr(key, "repeat", 0)
        # Mixed in only from the second repeat on, so the first's crop is the one a run
        # without repeats draws.
        return random.Random(epoch_seed(seed, repeat) if repeat else seed)

    # -- images --------------------------------------------------------------------------
    def load(self, source: str | Path | bytes | bytearray | memoryview, key: Any = 0) -> Any:
        """Decode an image file (a path) or its bytes, cropped and resized: a uint8
        ``3 x size x size`` tensor. Raises what Pillow raises for what it cannot read.

        A key that tells a size (a sampler's :class:`SampleKey` with ``size``: an
        image-size curriculum's epoch) is cut to that size instead. With the GPU decode
        on (``switch``), a baseline RGB JPEG comes back as an ``Encoded`` (its bytes and
        the crop drawn here, from the same generator) for the main process to decode."""
        rng = self.generator(key)
        size = getattr(key, "size", 0) or self.size
        opened = io.BytesIO(bytes(source)) if isinstance(source, (bytes, bytearray, memoryview)) else source
        with Image.open(opened) as image:
            # Parsed only where the file has EXIF data (most photos' cost is the decode).
            orientation = image.getexif().get(_EXIF_ORIENTATION, 1) if "exif" in image.info else 1
            raw_w, raw_h = image.size
            upright = (raw_h, raw_w) if orientation in (5, 6, 7, 8) else (raw_w, raw_h)
            left, top, right, bottom = self.box(*upright, rng)
            # Drawn before any decode: the GPU path draws the same flip from the same generator.
            flip = bool(rng is not None and self.hflip and rng.random() < self.hflip)
            if self.switch is not None and self.switch.on and image.format == "JPEG" and image.mode == "RGB":
                from slipstream.data.gpu_decode import encoded

                return encoded(source, (left, top, right, bottom), size, flip, orientation, self.interpolation)
            factor = min(right - left, bottom - top) / size
            if self.reduced_decoding and image.format == "JPEG" and factor >= 2:
                image.draft("RGB", (math.ceil(raw_w / factor), math.ceil(raw_h / factor)))
            shrink = raw_w / image.size[0]  # 1, 2, 4 or 8 after a draft
            image = _rgb(image)
            if orientation in _ORIENTATIONS:
                image = image.transpose(_ORIENTATIONS[orientation])
            box = (left / shrink, top / shrink, right / shrink, bottom / shrink)
            out = image.resize((size, size), INTERPOLATIONS[self.interpolation], box=box)
        if flip:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.array(out)).permute(2, 0, 1)

    def decode(self, data: bytes | bytearray | memoryview | str | Path, name: str, key: Any = 0) -> Any:
        """:meth:`load`, with what no decoder reads (or an empty file) a DataError
        naming the sample ``name``."""
        if isinstance(data, (bytes, bytearray, memoryview)) and not len(data):
            raise DataError(f"cannot decode {name}: the file is empty")
        try:
            return self.load(data, key)
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
            from slipstream.data.decode import _reason

            raise DataError(f"cannot decode {name}: {_reason(err)}") from None

    def apply(self, image: torch.Tensor, key: Any = 0) -> torch.Tensor:
        """The same crop and flip of an image already decoded (a uint8 ``C x H x W``
        tensor, as CIFAR's and the synthetic shapes are held)."""
        # torchvision only here: checking a config (geometries) must not import it.
        from torchvision.transforms import InterpolationMode, v2

        rng = self.generator(key)
        size = getattr(key, "size", 0) or self.size  # a curriculum's size, where the key tells one
        height, width = image.shape[-2:]
        if self.crop == "none" and (height, width) == (size, size):
            out = image
        else:
            left, top, right, bottom = self.box(width, height, rng)
            out = v2.functional.resized_crop(
                image,
                round(top),
                round(left),
                round(bottom - top),
                round(right - left),
                [size, size],
                interpolation=InterpolationMode(self.interpolation),
                antialias=True,
            )
        if rng is not None and self.hflip and rng.random() < self.hflip:
            out = v2.functional.horizontal_flip(out)
        return out


def _rgb(image: Image.Image) -> Image.Image:
    """Any of Pillow's modes as 8-bit RGB: 16-bit and 32-bit grey scaled to 0-255 (a
    plain convert would clip them to white), everything else converted."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        values = np.asarray(image).astype(np.float64)
        top = 65535.0 if image.mode.startswith("I;16") or values.max(initial=0) > 255 else 255.0
        grey = np.clip(np.rint(values * (255.0 / top)), 0, 255).astype(np.uint8)
        return Image.fromarray(grey, "L").convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def _random_resized_box(
    width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float], rng: random.Random
) -> tuple[float, float, float, float]:
    """torchvision's ``RandomResizedCrop.get_params``, drawn from ``rng`` (its own draws
    come from torch's global generator, which a per-sample seed would have to reset: a
    fifth of an image's decode in this loop)."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top, left = rng.randint(0, height - h), rng.randint(0, width - w)
            return float(left), float(top), float(left + w), float(top + h)
    # Fallback: the centre crop of the whole image, its aspect ratio held to ``ratio``.
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        w, h = round(height * max(ratio)), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return float(left), float(top), float(left + w), float(top + h)


def sample_key(name: str, epoch: int) -> SampleKey:
    """The key of a sample known by its name (a stream's ``shard:key``), in ``epoch``."""
    return SampleKey(_stable_hash(name) >> 2, epoch)


def _stable_hash(text: str) -> int:
    """A hash of ``text`` that is the same in every process (``hash()`` is salted)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def geometries(data: Any, photos: bool, seed: int = 0) -> tuple[Geometry, Geometry]:
    """The training and evaluation geometry of a config's ``data`` section (null keys
    take the dataset's defaults: ``photos`` or images made at their size); a bad value
    is a ConfigError naming the key and what is allowed."""
    from slipstream.errors import ConfigError

    def pair(key: str) -> tuple[float, float]:
        value = data.get(key)
        try:
            low, high = (float(v) for v in value)
        except (TypeError, ValueError):
            raise ConfigError(f"data.{key} must be two numbers [low, high], got {value!r}") from None
        if not 0 < low <= high:
            raise ConfigError(f"data.{key} must be [low, high] with 0 < low <= high, got {list(value)}")
        return low, high

    crop = data.get("train_crop") or ("random_resized" if photos else "none")
    if crop not in TRAIN_CROPS:
        raise ConfigError(f"data.train_crop must be one of {', '.join(TRAIN_CROPS)}, got {crop!r}")
    interpolation = data.get("interpolation") or "bilinear"
    if interpolation not in INTERPOLATIONS:
        raise ConfigError(f"data.interpolation must be one of {', '.join(INTERPOLATIONS)}, got {interpolation!r}")
    hflip = data.get("hflip")
    hflip = (0.5 if photos else 0.0) if hflip is None else float(hflip)
    if not 0 <= hflip <= 1:
        raise ConfigError(f"data.hflip is a probability, from 0 to 1, got {hflip}")
    crop_pct = data.get("crop_pct")
    crop_pct = (0.875 if photos else 1.0) if crop_pct is None else float(crop_pct)
    if not 0 < crop_pct <= 1:
        raise ConfigError(f"data.crop_pct is the centre crop's fraction of the shorter side, in (0, 1], got {crop_pct}")
    size = int(data.get("image_size") or 32)
    eval_size = data.get("eval_image_size")
    eval_size = size if eval_size is None else int(eval_size)
    if eval_size < 8:
        raise ConfigError(f"data.eval_image_size must be at least 8 pixels (or null: data.image_size), got {eval_size}")
    scale, ratio = pair("scale"), pair("ratio")
    if scale[1] > 1:
        raise ConfigError(f"data.scale is a fraction of the image's area, at most 1, got {list(scale)}")
    from slipstream.data.gpu_decode import decode_switch

    common = dict(interpolation=interpolation, reduced_decoding=bool(data.get("reduced_decoding", True)), seed=seed,
                  switch=decode_switch(data.get("decode")))  # fmt: skip
    # A centre crop for training is today's square of the whole shorter side.
    train = Geometry(size, crop=crop, scale=scale, ratio=ratio, hflip=hflip, **common)
    return train, Geometry(eval_size, crop="center" if photos or crop_pct < 1 else "none", crop_pct=crop_pct,
                           **common)  # fmt: skip
