"""Datasets and deterministic loaders.

Every item is `(image, target)`: a uint8 C x H x W tensor (0-255) and an int class
index. Batches stay uint8 through collate and transfer; the engine converts them to
float and normalises them on the device with `DATASET_STATS`, after every batch
transform (`slipstream.to_unit_float` gives a plugin float pixels in [0, 1]).
"""

from .datasets import DATASET_NAMES, DATASET_STATS, DataError, build_datasets
from .loaders import build_loader
from .sampler import EpochSampler
from .synthetic import SyntheticShapes

__all__ = [
    "DATASET_NAMES",
    "DATASET_STATS",
    "DataError",
    "EpochSampler",
    "SyntheticShapes",
    "build_datasets",
    "build_loader",
]
