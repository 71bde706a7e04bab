"""Image bytes to uint8 tensors, shared by the shard and table data sources.

The same decode and geometry as the ImageFolder source: torchvision.io (PIL as the
fallback for what it lacks), then the shorter side to ``image_size`` and the centre
crop, all on uint8; float conversion and normalisation happen later, on the device.
"""

from __future__ import annotations

import io
import re
import sys
from typing import Any

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import v2

try:  # deprecated since torchvision 0.29 (TorchCodec takes over); PIL when it is gone
    from torchvision.io import ImageReadMode, decode_image
except ImportError:  # pragma: no cover - depends on the torchvision release
    decode_image = None

from slipstream.errors import DataError

MAX_NAMED = 10  # unreadable samples named per process; past that, one line says naming stopped


def as_uint8(image: torch.Tensor) -> torch.Tensor:
    """A decoded image as 0-255 ``uint8``, as every source gives it: torchvision.io keeps
    a 16-bit PNG's ``uint16`` (a batch that mixed it with 8-bit images failed to stack)."""
    if image.dtype == torch.uint8:
        return image
    return v2.functional.to_dtype(image, torch.uint8, scale=True)


def _decode(encoded: torch.Tensor | str | None, opened: Any) -> torch.Tensor:
    """torchvision.io's decode of ``encoded`` (a file's path or its bytes; None: skip
    it), else PIL's of ``opened`` (what ``Image.open`` takes), which raises what it raises."""
    if decode_image is not None and encoded is not None:
        try:
            return as_uint8(decode_image(encoded, mode=ImageReadMode.RGB))
        except RuntimeError:
            pass  # a format torchvision.io lacks (BMP, TIFF, ...), or a corrupt one: PIL decides
    with Image.open(opened) as image:
        return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)


def read_rgb(path: str) -> torch.Tensor:
    """Decode an image file to a uint8 ``3 x H x W`` tensor (grey and RGBA become RGB).

    torchvision.io decodes PNG about 1.5x and JPEG about 1.3x as fast as PIL here
    (benchmarks/bench_imagefolder.py); PIL is the fallback for what it cannot read.
    """
    try:
        return _decode(path, path)
    except OSError as err:
        raise DataError(f"imagefolder: cannot decode {path}: {err}") from None


def decode_rgb(data: bytes | bytearray | memoryview, name: str) -> torch.Tensor:
    """Decode encoded image bytes to a uint8 ``3 x H x W`` tensor; a DataError naming
    ``name`` if they are no image either decoder can read."""
    encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else None
    try:
        return _decode(encoded, io.BytesIO(bytes(data)))
    except (OSError, SyntaxError, ValueError) as err:
        raise DataError(f"cannot decode {name}: {_reason(err)}") from None


def _reason(err: BaseException) -> str:
    """PIL's error in words: without the ``<_io.BytesIO object at 0x...>`` it names the
    bytes by (``name`` is the sample's name)."""
    text = re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "", " ".join(str(err).split()))
    if text == "cannot identify image file":
        return "not an image file (no format Pillow or torchvision reads)"
    return text or type(err).__name__


class ResizeCrop:
    """The shorter side to ``size``, then the centre ``size x size`` (as ImageFolder does)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.tf = v2.Compose([v2.Resize(size), v2.CenterCrop(size)])

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if image.shape[-2:] == (self.size, self.size):
            return image
        return self.tf(image)


class SkipLog:
    """Names each unreadable sample once on stderr (the first MAX_NAMED per log), for
    every source that skips them."""

    def __init__(self, where: str | None) -> None:
        # What the replacement comes from ("shard", "image's class"); None: no
        # replacement, the sample is left out (an evaluation).
        self.where = where
        self.skipped: list[str] = []

    def warn(self, name: str, reason: str) -> None:
        if name in self.skipped:
            return  # named once (a later epoch reads it again)
        self.skipped.append(name)
        reason = reason.removeprefix(f"cannot decode {name}: ")  # the name is in the line already
        if len(self.skipped) <= MAX_NAMED:
            instead = (
                f"the next image in the {self.where} is used in its place"
                if self.where
                else "it is left out of the evaluation"
            )
            print(f"slipstream: warning: skipping unreadable image {name} ({reason}); {instead}", file=sys.stderr)
        if len(self.skipped) == MAX_NAMED:
            print(
                f"slipstream: warning: {MAX_NAMED} unreadable images named; "
                "further ones are skipped without a message",
                file=sys.stderr,
            )
