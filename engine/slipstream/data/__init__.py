"""Datasets and deterministic loaders.

Every item is `(image, target)`: a float32 C x H x W tensor in [0, 1] (not normalised:
the engine normalises on the device with `DATASET_STATS`) and an int class index.
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
