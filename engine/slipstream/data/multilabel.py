"""SyntheticMultiLabel: several shapes per image, the label vector says which are present.

The multi-label counterpart of :mod:`slipstream.data.synthetic` (``data.name:
synthetic_multilabel``): each image shows between one and ``max_shapes`` different
shapes of the first ``num_classes`` of :data:`LABELS` (the single-label set's shapes), each
in a cell of a 2 x 2 grid (jittered, so shapes do not overlap), in a colour of its own,
on the same backgrounds, clutter and pixel noise as the single-label set. The target is
a multi-hot float vector ``(num_classes,)``: 1 where the shape is in the picture.
Everything is drawn from streams seeded by ``(seed, split, index)``: sample ``i`` is the
same picture whatever the split's size, and the same scene at any resolution.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch.utils.data import Dataset

from slipstream.data.synthetic import (
    _LABELS,
    _POLYGONS,
    SPLITS,
    _Canvas,
    _contrasting_colour,
    _entropy,
    _place,
    _processes_for,
    _rgb,
    _supersample,
    check_split_and_sizes,
    compose,
)

# One class per shape (a pair of one shape is no other label here), those a small model
# tells apart soonest at 16 px first (a hole, a plus, a narrow rhombus; three thin bars
# need more pixels): with a few classes (a test, a quick look) the task is easy, with
# all ten as hard as the single-label set's.
LABELS: tuple[str, ...] = (
    "ring", "cross", "diamond", "triangle", "l_shape", "crescent", "star", "square", "circle", "bars",
)  # fmt: skip
MIN_CLASSES = 2
MAX_CLASSES = len(LABELS)
CELLS = 4  # the 2 x 2 grid: at most this many shapes per image
TASK = "multilabel"


def draw_labels(seed: int, split_id: int, index: int, num_classes: int, max_shapes: int) -> np.ndarray:
    """The classes present in sample ``index``: how many (1 to ``max_shapes``, uniform),
    then which (a uniform subset), from a stream of the sample's own."""
    rng = np.random.default_rng(_entropy(seed, _LABELS, split_id, index))
    count = int(rng.integers(1, max_shapes + 1))
    return np.sort(rng.choice(num_classes, size=count, replace=False))


def _render_sample(
    seed: int, split_id: int, index: int, present: np.ndarray, image_size: int, canvas: _Canvas
) -> np.ndarray:
    """One sample as an H x W x 3 uint8 array: each present class's shape in a cell of
    its own, composed as the single-label set composes its scenes (:func:`compose`)."""

    def paint(rng: np.random.Generator, img: Image.Image, bg_mean: Any) -> None:
        size = canvas.size
        cells = rng.permutation(CELLS)[: len(present)]
        for label, cell in zip(present, cells, strict=True):
            radius = rng.uniform(0.15, 0.21)
            # The cell's centre (0.25 or 0.75 on each axis), moved at most so far that the
            # shape stays inside its cell.
            slack = max(0.0, 0.24 - radius)
            cx = 0.25 + 0.5 * (cell % 2) + rng.uniform(-slack, slack)
            cy = 0.25 + 0.5 * (cell // 2) + rng.uniform(-slack, slack)
            mask = Image.new("L", (size, size), 0)
            mask_draw = ImageDraw.Draw(mask)
            for value, pts in _place(_POLYGONS[LABELS[int(label)]], cx, cy, radius, rng.uniform(0, 2 * np.pi), size):
                mask_draw.polygon(pts, fill=value)
            img.paste(_rgb(_contrasting_colour(rng, bg_mean)), (0, 0), mask)

    return compose(seed, split_id, index, image_size, canvas, paint)


def _render_range(args: tuple[int, int, int, list[np.ndarray], int]) -> np.ndarray:
    seed, split_id, start, labels, image_size = args
    canvas = _Canvas(image_size * _supersample(image_size))
    out = np.empty((len(labels), image_size, image_size, 3), dtype=np.uint8)
    for offset, present in enumerate(labels):
        out[offset] = _render_sample(seed, split_id, start + offset, present, image_size, canvas)
    return out


def _render(seed: int, split_id: int, labels: list[np.ndarray], image_size: int) -> np.ndarray:
    """Every sample of a split, in forked processes for a large set (as the single-label set)."""
    processes = _processes_for(len(labels))
    if processes == 1:
        return _render_range((seed, split_id, 0, labels, image_size))
    bounds = np.linspace(0, len(labels), processes * 4 + 1).astype(int)
    spans = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
    chunks = [(seed, split_id, a, labels[a:b], image_size) for a, b in spans]
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        return np.concatenate(pool.map(_render_range, chunks))


class SyntheticMultiLabel(Dataset):
    """Several shapes per image; items are ``(uint8 C x H x W, float32 multi-hot (num_classes,))``.

    Rendered eagerly into ``self.images`` (uint8) and ``self.targets`` (float32
    ``N x num_classes``), so indexing is a view and the default collate stacks the
    targets into the ``(N, num_classes)`` float batch that ``loss.name=bce`` takes.
    """

    task = TASK  # what the evaluation and the metrics read: multi-hot targets

    def __init__(
        self,
        size: int,
        image_size: int = 32,
        num_classes: int = 10,
        seed: int = 0,
        split: str = "train",
        max_shapes: int = 3,
    ) -> None:
        if not MIN_CLASSES <= num_classes <= MAX_CLASSES:
            raise ValueError(
                f"num_classes must be from {MIN_CLASSES} to {MAX_CLASSES} (one per shape: {', '.join(LABELS)}); "
                f"got {num_classes}"
            )
        if not 1 <= max_shapes <= min(CELLS, num_classes):
            raise ValueError(
                f"max_shapes must be from 1 to {min(CELLS, num_classes)} (the 2 x 2 grid's cells, and no more "
                f"than num_classes={num_classes}); got {max_shapes}"
            )
        check_split_and_sizes(split, size, image_size)
        self.size, self.image_size, self.num_classes = size, image_size, num_classes
        self.seed, self.split, self.max_shapes = seed, split, max_shapes
        self.classes = list(LABELS[:num_classes])
        split_id = SPLITS.index(split)
        labels = [draw_labels(seed, split_id, i, num_classes, max_shapes) for i in range(size)]
        targets = torch.zeros(size, num_classes, dtype=torch.float32)
        for i, present in enumerate(labels):
            targets[i, torch.from_numpy(present)] = 1.0
        self.targets = targets
        self.images = torch.from_numpy(_render(seed, split_id, labels, image_size)).permute(0, 3, 1, 2).contiguous()

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.targets[index]

    def __repr__(self) -> str:
        return (
            f"SyntheticMultiLabel(size={self.size}, image_size={self.image_size}, num_classes={self.num_classes}, "
            f"max_shapes={self.max_shapes}, seed={self.seed}, split={self.split!r})"
        )


def label_frequencies(dataset: Any) -> torch.Tensor:
    """The share of samples each class is present in (what a model that ignores the
    image would predict: the chance level of a multi-label set)."""
    return dataset.targets.float().mean(0)
