"""timm's RandomErasing (``timm/data/random_erasing.py``) on a whole batch, on its device.

timm erases each image of a *normalised* tensor: with probability ``probability``,
``count`` boxes (one draw in [min, max] per image), each of a random area (a fraction
of the image, divided by the count) and log-uniform aspect ratio, up to 10 tries for
a box that fits, filled with zeros (``const``: the dataset's mean colour once
normalised), one normal colour per box (``rand``) or normal noise per pixel
(``pixel``). The boxes are drawn for the whole batch on the host with one CPU
generator (no device synchronisation, the same boxes on any device); the noise is
drawn on the batch's device with a generator seeded alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

MODES = ("const", "rand", "pixel")
ATTEMPTS = 10  # timm's tries per box


@dataclass(frozen=True)
class Erasing:
    """timm's RandomErasing arguments (``count`` is timm's ``min_count``/``max_count``)."""

    probability: float = 0.5
    mode: str = "const"
    count: tuple[int, int] = (1, 1)
    min_area: float = 0.02
    max_area: float = 1 / 3
    min_aspect: float = 0.3
    max_aspect: float | None = None  # None: 1 / min_aspect

    def __post_init__(self) -> None:
        def bad(key: str, allowed: str) -> ValueError:
            return ValueError(f"erasing.{key} must be {allowed}, got {getattr(self, key)!r}")

        if not _number(self.probability) or not 0 <= self.probability <= 1:
            raise bad("probability", "a number in [0, 1]")
        if self.mode not in MODES:
            raise bad("mode", f"one of {', '.join(MODES)}")
        low, high = self.count
        if not 1 <= low <= high:
            raise bad("count", "a whole number >= 1 or [min, max] with 1 <= min <= max")
        if not _number(self.min_area) or not 0 < self.min_area <= 1:
            raise bad("min_area", "a number in (0, 1]")
        if not _number(self.max_area) or not self.min_area <= self.max_area <= 1:
            raise bad("max_area", "a number in [min_area, 1]")
        if not _number(self.min_aspect) or self.min_aspect <= 0:
            raise bad("min_aspect", "a number > 0")
        if self.max_aspect is not None and (not _number(self.max_aspect) or self.max_aspect < self.min_aspect):
            raise bad("max_aspect", "null or a number >= min_aspect")

    @property
    def log_aspect(self) -> tuple[float, float]:
        return math.log(self.min_aspect), math.log(self.max_aspect or 1 / self.min_aspect)

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> Erasing:
        """From the plugin's ``erasing`` mapping; a ValueError names a wrong key or value."""
        allowed = [f for f in cls.__dataclass_fields__]
        for key in options:
            if key not in allowed:
                raise ValueError(f"erasing: unknown key {key!r}; allowed keys: {', '.join(allowed)}")
        options = dict(options)
        count = options.get("count", 1)
        if _whole(count):
            options["count"] = (int(count), int(count))
        elif isinstance(count, (list, tuple)) and len(count) == 2 and all(map(_whole, count)):
            options["count"] = (int(count[0]), int(count[1]))
        else:
            raise ValueError(
                f"erasing.count must be a whole number >= 1 or [min, max] with 1 <= min <= max, got {count!r}"
            )
        return cls(**options)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value: Any) -> bool:
    return _number(value) and float(value).is_integer()


@dataclass
class Boxes:
    """The boxes of one batch, by slot (the j-th box of each image), on the host."""

    slots: list[tuple[torch.Tensor, torch.Tensor]]  # per slot: image rows, (k, 4) top, left, h, w


def draw_boxes(erasing: Erasing, shape: torch.Size, generator: torch.Generator) -> Boxes:
    """timm's ``_erase`` draws for every image of a batch of ``shape``, in a fixed order."""
    n, _, height, width = shape
    low, high = erasing.count

    def uniform(*shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=generator, dtype=torch.float64)

    erase = uniform(n) <= erasing.probability  # timm skips an image when random() > p
    count = torch.randint(low, high + 1, (n,), generator=generator)
    tries = (n, high, ATTEMPTS)
    fraction = erasing.min_area + (erasing.max_area - erasing.min_area) * uniform(*tries)
    area = height * width * fraction / count.view(-1, 1, 1)
    log_low, log_high = erasing.log_aspect
    aspect = torch.exp(log_low + (log_high - log_low) * uniform(*tries))
    h = torch.sqrt(area * aspect).round().long()  # Python's round, like torch's, halves to even
    w = torch.sqrt(area / aspect).round().long()
    fits = (h < height) & (w < width)
    first = torch.where(fits, torch.arange(ATTEMPTS), ATTEMPTS).amin(-1)  # (n, high): the try kept
    found = first < ATTEMPTS
    pick = first.clamp(max=ATTEMPTS - 1).unsqueeze(-1)
    h, w = h.gather(-1, pick).squeeze(-1), w.gather(-1, pick).squeeze(-1)
    u = uniform(n, high, 2)
    top = (u[..., 0] * (height - h + 1)).floor().long()  # randint(0, height - h)
    left = (u[..., 1] * (width - w + 1)).floor().long()
    slots = []
    for j in range(high):
        rows = (erase & (count > j) & found[:, j]).nonzero().flatten()
        if rows.numel():
            slots.append((rows, torch.stack([top[rows, j], left[rows, j], h[rows, j], w[rows, j]], 1)))
    return Boxes(slots)


def random_erase(inputs: torch.Tensor, erasing: Erasing, seed: int) -> torch.Tensor:
    """Erase boxes of ``inputs`` (``(N, C, H, W)``, normalised, as timm's RandomErasing
    expects) per image; returns a new tensor, ``inputs`` is not modified. ``seed`` fixes
    the boxes (drawn on the host) and the noise (drawn on ``inputs``' device)."""
    out = inputs.clone()
    boxes = draw_boxes(erasing, inputs.shape, torch.Generator().manual_seed(seed))
    if not boxes.slots:
        return out
    noise = torch.Generator(device=inputs.device).manual_seed(seed) if erasing.mode != "const" else None
    c = inputs.shape[1]
    # Image by image, box by box (a later box paints over an earlier one), as timm: the
    # boxes are host numbers, so each is a slice assignment, with no device sync; few
    # images are erased at timm's probabilities, so this costs less than masking all.
    ordered = sorted(
        (image, slot, *box)
        for slot, (rows, coords) in enumerate(boxes.slots)
        for image, box in zip(rows.tolist(), coords.tolist(), strict=True)
    )
    for image, _, top, left, h, w in ordered:
        if erasing.mode == "pixel":
            fill = torch.randn((c, h, w), generator=noise, device=inputs.device, dtype=inputs.dtype)
        elif erasing.mode == "rand":
            fill = torch.randn((c, 1, 1), generator=noise, device=inputs.device, dtype=inputs.dtype)
        else:
            fill = torch.zeros((), device=inputs.device, dtype=inputs.dtype)
        out[image, :, top : top + h, left : left + w] = fill
    return out
