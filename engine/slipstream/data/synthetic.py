"""SyntheticShapes: a procedurally rendered image classification dataset.

The class of an image is the kind of shape drawn on it (and, past ten classes, whether
the shape appears once or as a pair). Everything else varies per sample and carries no
label information: colours, background (gradient, blotchy texture, stripes), position,
scale, rotation, clutter and pixel noise. The scene is described in normalised
coordinates and rasterised on a supersampled canvas, then box-filtered down, so one
sample rendered at 32 px and at 64 px shows the same picture.
"""

from __future__ import annotations

import math
import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch.utils.data import Dataset

SHAPES: tuple[str, ...] = (
    "circle",
    "square",
    "triangle",
    "cross",
    "ring",
    "star",
    "bars",
    "diamond",
    "crescent",
    "l_shape",
)
MIN_CLASSES = 2
MAX_CLASSES = 2 * len(SHAPES)
SPLITS = ("train", "val")

# Tags that keep the independent random streams of one sample apart.
_SCENE, _LABELS, _NOISE = 1, 2, 3


def _regular(n: int, radius: float = 1.0, phase: float = 0.0) -> list[tuple[float, float]]:
    angles = [phase + 2 * math.pi * k / n for k in range(n)]
    return [(radius * math.cos(a), radius * math.sin(a)) for a in angles]


def _star(points: int, outer: float, inner: float) -> list[tuple[float, float]]:
    verts = []
    for k in range(2 * points):
        r = outer if k % 2 == 0 else inner
        a = -math.pi / 2 + math.pi * k / points
        verts.append((r * math.cos(a), r * math.sin(a)))
    return verts


def _rect(x0: float, y0: float, x1: float, y1: float) -> list[tuple[float, float]]:
    return [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]


def _shape_polygons() -> dict[str, list[tuple[int, list[tuple[float, float]]]]]:
    """Each shape as polygons in a unit frame, drawn in order with value 255 or 0 (a hole).

    Shapes are chosen to stay distinct under any rotation (the diamond is a narrow
    rhombus, not a rotated square) and are roughly the same size, so neither
    orientation nor area gives the class away.
    """
    a = 0.3  # half-width of the cross arms
    return {
        "circle": [(255, _regular(48))],
        "square": [(255, _rect(-0.82, -0.82, 0.82, 0.82))],
        "triangle": [(255, _regular(3, 1.1, -math.pi / 2))],
        "cross": [
            (
                255,
                [
                    (-a, -1),
                    (a, -1),
                    (a, -a),
                    (1, -a),
                    (1, a),
                    (a, a),
                    (a, 1),
                    (-a, 1),
                    (-a, a),
                    (-1, a),
                    (-1, -a),
                    (-a, -a),
                ],
            ),
        ],
        "ring": [(255, _regular(48)), (0, _regular(48, 0.55))],
        "star": [(255, _star(5, 1.1, 0.45))],
        "bars": [(255, _rect(-0.9, y - 0.17, 0.9, y + 0.17)) for y in (-0.62, 0.0, 0.62)],
        "diamond": [(255, [(0, -1.1), (0.5, 0), (0, 1.1), (-0.5, 0)])],
        "crescent": [(255, _regular(48)), (0, [(x + 0.55, y) for x, y in _regular(48, 0.85)])],
        "l_shape": [
            (255, [(-0.75, -1), (-0.2, -1), (-0.2, 0.45), (0.75, 0.45), (0.75, 1), (-0.75, 1)])
        ],
    }


_POLYGONS = _shape_polygons()


def class_names(num_classes: int) -> list[str]:
    """Human-readable names of the first `num_classes` classes."""
    names = list(SHAPES) + [f"pair_of_{s}" for s in SHAPES]
    return names[:num_classes]


def _supersample(image_size: int) -> int:
    # At least 2x, and a canvas of at least 64 px so small renders are still antialiased.
    return max(2, math.ceil(64 / image_size))


def _entropy(seed: int, *words: int) -> list[int]:
    # SeedSequence needs non-negative words; fold negative seeds into 64 bits.
    return [w % (1 << 64) for w in (seed, *words)]


def _contrasting_colour(rng: np.random.Generator, against: np.ndarray) -> np.ndarray:
    """A colour far enough from `against` to be visible, but how far varies per sample."""
    min_dist = rng.uniform(0.35, 0.6)
    colour = rng.random(3)
    for _ in range(20):
        if np.linalg.norm(colour - against) >= min_dist:
            break
        colour = rng.random(3)
    else:
        # Rare: every draw landed near the background; push away from it instead.
        colour = np.where(against > 0.5, against - 0.5, against + 0.5)
    return colour



def check_split_and_sizes(split: str, size: int, image_size: int) -> None:
    """The arguments every built-in synthetic dataset takes, checked alike."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}; got {split!r}")
    if size < 0:
        raise ValueError(f"size must be >= 0; got {size}")
    if image_size < 8:
        raise ValueError(f"image_size must be >= 8; got {image_size}")

class _Canvas:
    """Pixel-coordinate grids for one canvas size, shared by every sample of a render."""

    def __init__(self, size: int) -> None:
        self.size = size
        ax = (np.arange(size, dtype=np.float32) + 0.5) / size
        self.x = ax[None, :]
        self.y = ax[:, None]


def _rgb(colour: np.ndarray) -> tuple[int, int, int]:
    r, g, b = (int(v * 255 + 0.5) for v in colour)
    return r, g, b


def _background(rng: np.random.Generator, canvas: _Canvas) -> tuple[Image.Image, np.ndarray]:
    """Render the background as an RGB image; also return its mean colour in [0, 1].

    Only the blend weight map is computed in NumPy; PIL mixes the two colours with it,
    which is several times faster than blending three float channels per sample.
    """
    c1 = rng.random(3)
    # The second colour stays near the first, so textures do not swamp the shape.
    c2 = np.clip(c1 + rng.uniform(-0.3, 0.3, 3), 0, 1)
    kind = rng.integers(4)
    angle = rng.uniform(0, 2 * math.pi)
    size = canvas.size
    if kind == 0:  # flat
        return Image.new("RGB", (size, size), _rgb(c1)), c1
    along = canvas.x * math.cos(angle) + canvas.y * math.sin(angle)
    if kind == 1:  # linear gradient
        t = (along - along.min()) / max(float(along.max() - along.min()), 1e-6)
    elif kind == 2:  # stripes
        freq = rng.uniform(2.0, 7.0)
        t = 0.5 + 0.5 * np.sin(2 * math.pi * freq * along + rng.uniform(0, 2 * math.pi))
    else:  # blotchy low-frequency texture, bilinear upsampling of a coarse random grid
        cells = int(rng.integers(3, 7))
        grid = rng.random((cells, cells)).astype(np.float32)
        t = np.asarray(Image.fromarray(grid).resize((size, size), Image.BILINEAR))
    weight = Image.fromarray((t * 255 + 0.5).astype(np.uint8))
    first, second = (Image.new("RGB", (size, size), _rgb(c)) for c in (c1, c2))
    return Image.composite(second, first, weight), c1 + (c2 - c1) * float(t.mean())


def _place(
    polygons: list[tuple[int, list[tuple[float, float]]]],
    cx: float,
    cy: float,
    radius: float,
    angle: float,
    size: int,
) -> list[tuple[int, list[tuple[float, float]]]]:
    c, s = math.cos(angle), math.sin(angle)
    k = radius * size
    return [
        (
            value,
            [
                ((cx * size) + k * (c * x - s * y), (cy * size) + k * (s * x + c * y))
                for x, y in pts
            ],
        )
        for value, pts in polygons
    ]


def _shape_mask(rng: np.random.Generator, shape: str, count: int, size: int) -> Image.Image:
    """Draw one or two copies of `shape` into a canvas-sized 'L' mask."""
    mask = Image.new("L", (size, size), 0)
    draw = ImageDraw.Draw(mask)
    if count == 1:
        radius = rng.uniform(0.2, 0.36)
        centres = [rng.uniform(radius + 0.03, 1 - radius - 0.03, 2)]
        radii = [radius]
    else:
        # Two copies on opposite sides of a random axis through a jittered centre.
        radii = list(rng.uniform(0.13, 0.19, 2))
        axis = rng.uniform(0, 2 * math.pi)
        gap = radii[0] + radii[1] + rng.uniform(0.04, 0.12)
        mid = 0.5 + rng.uniform(-0.06, 0.06, 2)
        d = np.array([math.cos(axis), math.sin(axis)])
        centres = [mid - d * gap / 2, mid + d * gap / 2]
        centres = [np.clip(c, r + 0.02, 1 - r - 0.02) for c, r in zip(centres, radii, strict=True)]
    for (cx, cy), radius in zip(centres, radii, strict=True):
        placed = _place(_POLYGONS[shape], cx, cy, radius, rng.uniform(0, 2 * math.pi), size)
        for value, pts in placed:
            draw.polygon(pts, fill=value)
    return mask


def _clutter(rng: np.random.Generator, draw: ImageDraw.ImageDraw, size: int) -> None:
    """A few small blobs and short strokes in random colours."""
    for _ in range(int(rng.integers(0, 4))):
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        cx, cy = rng.random(2) * size
        if rng.random() < 0.5:
            r = rng.uniform(0.02, 0.05) * size
            draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
        else:
            length = rng.uniform(0.08, 0.22) * size
            a = rng.uniform(0, 2 * math.pi)
            dx, dy = length * math.cos(a) / 2, length * math.sin(a) / 2
            width = max(1, round(rng.uniform(0.012, 0.025) * size))
            draw.line((cx - dx, cy - dy, cx + dx, cy + dy), fill=colour, width=width)


def compose(
    seed: int, split_id: int, index: int, image_size: int, canvas: _Canvas, paint: Callable[..., None]
) -> np.ndarray:
    """One sample as an H x W x 3 uint8 array: background, clutter behind or in front,
    ``paint(rng, img, bg_mean)`` for the labelled shapes, then the reduction to
    ``image_size`` and pixel noise (the multi-label set composes its scenes the same way).

    All scene parameters are drawn, in a fixed order, from a stream that does not depend
    on `image_size`; only the final pixel noise has a per-resolution stream.
    """
    rng = np.random.default_rng(_entropy(seed, _SCENE, split_id, index))
    size = canvas.size
    img, bg_mean = _background(rng, canvas)
    draw = ImageDraw.Draw(img)
    clutter_in_front = rng.random() < 0.5
    if not clutter_in_front:
        _clutter(rng, draw, size)
    paint(rng, img, bg_mean)
    if clutter_in_front:
        _clutter(rng, draw, size)
    noise_sigma = rng.uniform(0.0, 0.06) * 255
    out = np.asarray(img.reduce(size // image_size), dtype=np.float32)
    noise_rng = np.random.default_rng(_entropy(seed, _NOISE, split_id, index, image_size))
    out = out + noise_rng.standard_normal(out.shape, dtype=np.float32) * noise_sigma
    return np.clip(out + 0.5, 0, 255).astype(np.uint8)


def _render_sample(
    seed: int, split_id: int, index: int, label: int, image_size: int, canvas: _Canvas
) -> np.ndarray:
    """Render one sample (shape ``label`` names, as many as it says) as an H x W x 3 uint8 array."""

    def paint(rng: np.random.Generator, img: Image.Image, bg_mean: Any) -> None:
        shape, count = SHAPES[label % len(SHAPES)], 1 + label // len(SHAPES)
        mask = _shape_mask(rng, shape, count, canvas.size)
        img.paste(_rgb(_contrasting_colour(rng, bg_mean)), (0, 0), mask)

    return compose(seed, split_id, index, image_size, canvas, paint)


# Sets at least this large are rendered by several processes: a fork costs a few ms,
# a sample about 0.4 ms. On an H100 machine the 30,000 images of the GPU check took
# most of the 22-27 s before training, rendered by one core of sixteen.
PARALLEL_MIN_SAMPLES = 4096
_MAX_PROCESSES = 16


def _render_range(
    seed: int, split_id: int, start: int, labels: np.ndarray, image_size: int
) -> np.ndarray:
    """Samples ``start .. start + len(labels)`` as an N x H x W x 3 uint8 array."""
    canvas = _Canvas(image_size * _supersample(image_size))
    out = np.empty((len(labels), image_size, image_size, 3), dtype=np.uint8)
    for offset, label in enumerate(labels):
        out[offset] = _render_sample(seed, split_id, start + offset, int(label), image_size, canvas)
    return out


def _render_range_args(args: tuple[int, int, int, np.ndarray, int]) -> np.ndarray:
    return _render_range(*args)


def _processes_for(size: int) -> int:
    """How many processes render ``size`` samples: one for a small set, where
    processes cannot be forked, or in a daemonic process (which may have no children).
    Each sample depends only on its own seed, so the pixels are the same whatever the count."""
    if (
        size < PARALLEL_MIN_SAMPLES
        or "fork" not in multiprocessing.get_all_start_methods()
        or multiprocessing.current_process().daemon
    ):
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, _MAX_PROCESSES, size // (PARALLEL_MIN_SAMPLES // 4)))


def render_samples(seed: int, split_id: int, labels: np.ndarray, image_size: int) -> np.ndarray:
    """Every sample of a split, N x H x W x 3 uint8, in forked processes for a large set."""
    processes = _processes_for(len(labels))
    if processes == 1:
        return _render_range(seed, split_id, 0, labels, image_size)
    bounds = np.linspace(0, len(labels), processes * 4 + 1).astype(int)  # 4 chunks each: even finish
    spans = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
    chunks = [(seed, split_id, a, labels[a:b], image_size) for a, b in spans]
    # fork: the children need no import and no pickled module state; they only render.
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        return np.concatenate(pool.map(_render_range_args, chunks))


def _balanced_labels(seed: int, split_id: int, size: int, num_classes: int) -> np.ndarray:
    """Each consecutive block of `num_classes` indices holds every class once, shuffled.

    Per-block shuffling keeps the label of an index independent of the dataset size, so
    sample i is the same picture whether the split has 100 or 100 000 samples.
    """
    labels = np.empty(size, dtype=np.int64)
    for block_start in range(0, size, num_classes):
        rng = np.random.default_rng(_entropy(seed, _LABELS, split_id, block_start // num_classes))
        block = rng.permutation(num_classes)
        labels[block_start : block_start + num_classes] = block[: size - block_start]
    return labels


class SyntheticShapes(Dataset):
    """Procedurally generated shapes; items are `(uint8 C x H x W, int label)`.

    Samples are rendered eagerly into one uint8 tensor (`self.images`), so indexing is a
    view (the engine converts batches to float on the device). The same
    `(seed, split, index, image_size)` always gives the same tensor; the train and val
    splits are drawn from independent random streams.
    """

    def __init__(
        self,
        size: int,
        image_size: int = 32,
        num_classes: int = 10,
        seed: int = 0,
        split: str = "train",
    ) -> None:
        if not MIN_CLASSES <= num_classes <= MAX_CLASSES:
            raise ValueError(
                f"SyntheticShapes supports num_classes from {MIN_CLASSES} to {MAX_CLASSES} "
                f"({len(SHAPES)} shapes, single or paired); got {num_classes}"
            )
        check_split_and_sizes(split, size, image_size)
        self.size = size
        self.image_size = image_size
        self.num_classes = num_classes
        self.seed = seed
        self.split = split
        self.classes = class_names(num_classes)

        split_id = SPLITS.index(split)
        labels = _balanced_labels(seed, split_id, size, num_classes)
        images = render_samples(seed, split_id, labels, image_size)
        self.images = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()
        self.targets = torch.from_numpy(labels)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.targets[index])

    def __repr__(self) -> str:
        return (
            f"SyntheticShapes(size={self.size}, image_size={self.image_size}, "
            f"num_classes={self.num_classes}, seed={self.seed}, split={self.split!r})"
        )
