"""CutMix: paste a box of another image into each image, and mix the labels by area.

Each training batch is changed on the device at ``batch_start``: a box, one per
batch, is cut from the batch rolled by one and pasted into every image (Yun et al.
2019). Its size follows ``lam ~ Beta(alpha, alpha)`` (or, with ``minmax``, a
height and width drawn as fractions of the image, as timm's ``cutmix_minmax``);
the labels become ``lam * own + (1 - lam) * other`` where ``lam`` is the share of
the image left after the box is clipped to the border. Pixels are only moved, so
a ``uint8`` batch stays ``uint8``.

Targets become class probabilities ``(N, num_classes)`` exactly as with
``mixup`` (the functions are shared with ``slipstream-mixup``): the engine's
cross-entropy takes them, ``label_smoothing`` smooths them, evaluation is not
touched, and every draw comes from a generator seeded per batch, so a resumed run
continues exactly.

With ``mixup`` in the same run the two switch per batch, as timm's Mixup does
(``switch_prob``, its ``--mixup-switch-prob``): a draw seeded per batch picks CutMix
with probability ``switch_prob`` and MixUp otherwise, never both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from slipstream_mixup import BatchMixing, draw_lambda, mix_targets

from slipstream import check_plugin_options, plugin_option

Box = tuple[int, int, int, int]  # top, bottom, left, right (bottom/right exclusive)


@dataclass
class CutmixConfig:
    # Beta(alpha, alpha) for the kept area; 1.0 = uniform
    alpha: float = plugin_option(1.0, low=0, low_open=True, note="the Beta distribution's parameter")
    prob: float = plugin_option(1.0, low=0, high=1, note="the fraction of batches mixed")
    # [min, max]: box height and width drawn uniformly as fractions of the image
    # (alpha is then unused); null: the box's area follows alpha.
    minmax: Optional[list[float]] = plugin_option(None, low=0, high=1, low_open=True, items=True)
    # None: the run's (model.num_classes, or the model's head)
    num_classes: Optional[int] = plugin_option(None, low=2, whole=True, note="or null: the run's")
    # With mixup enabled too: the share of batches that are CutMix's (the rest are
    # MixUp's), timm's --mixup-switch-prob. Unused without mixup.
    switch_prob: float = plugin_option(0.5, low=0, high=1, note="with mixup: the share of batches cut")

    def __post_init__(self) -> None:
        check_plugin_options(self)
        if self.minmax is not None:
            bounds = list(self.minmax)
            if len(bounds) != 2 or not bounds[0] <= bounds[1]:
                raise ValueError(
                    f"minmax must be null or [min, max] with 0 < min <= max <= 1 "
                    f"(box sides as fractions of the image), got {bounds}"
                )


def cutmix_box(
    height: int,
    width: int,
    lam: float,
    generator: np.random.Generator,
    minmax: list[float] | None = None,
) -> Box:
    """A box whose area is about ``1 - lam`` of the image, centred uniformly and
    clipped to the border (timm's ``rand_bbox``); with ``minmax``, sides drawn as
    fractions of the image and placed wholly inside it (``rand_bbox_minmax``)."""
    if minmax is not None:
        cut_h = int(generator.integers(int(height * minmax[0]), int(height * minmax[1]) + 1))
        cut_w = int(generator.integers(int(width * minmax[0]), int(width * minmax[1]) + 1))
        top = int(generator.integers(0, height - cut_h + 1))
        left = int(generator.integers(0, width - cut_w + 1))
        return top, top + cut_h, left, left + cut_w
    ratio = float(np.sqrt(1.0 - lam))
    cut_h, cut_w = int(height * ratio), int(width * ratio)
    cy, cx = int(generator.integers(0, height)), int(generator.integers(0, width))
    top, bottom = np.clip([cy - cut_h // 2, cy + cut_h // 2], 0, height)
    left, right = np.clip([cx - cut_w // 2, cx + cut_w // 2], 0, width)
    return int(top), int(bottom), int(left), int(right)


def cutmix_batch(
    inputs: torch.Tensor,
    targets: torch.Tensor,
    num_classes: int,
    alpha: float = 1.0,
    generator: np.random.Generator | None = None,
    minmax: list[float] | None = None,
    box: Box | None = None,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Paste ``box`` (drawn with ``generator`` unless given) of each sample's
    neighbour (the batch rolled by one) into it.

    ``inputs`` is ``(N, C, H, W)`` of any dtype, kept. Returns the new batch, the
    soft targets ``(N, num_classes)`` and ``lam``, the share of each image that is
    its own. ``inputs`` and ``targets`` are not modified.
    """
    height, width = inputs.shape[-2:]
    if box is None:
        generator = generator if generator is not None else np.random.default_rng()
        lam = 1.0 if minmax is not None else draw_lambda(alpha, generator)
        box = cutmix_box(height, width, lam, generator, minmax)
    top, bottom, left, right = box
    out = inputs.clone()
    out[..., top:bottom, left:right] = inputs[..., top:bottom, left:right].roll(1, 0)
    lam = 1.0 - (bottom - top) * (right - left) / (height * width)
    return out, mix_targets(targets, num_classes, lam), lam


class Cutmix(BatchMixing):
    """CutMix: paste a box of another image into each one and mix the labels by area."""

    name = "cutmix"
    config_class = CutmixConfig
    # With mixup: one of the two mixes each batch (switch_prob), never both.
    switch_partner = "mixup"

    def mix(
        self, inputs: torch.Tensor, targets: torch.Tensor, rng: np.random.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        mixed, soft, _ = cutmix_batch(inputs, targets, self.num_classes, c.alpha, rng, c.minmax)
        return mixed, soft
