"""Datasets and deterministic loaders; the API dataset plugins import (as algorithms
import ``slipstream``).

Every item is `(image, target)`: a uint8 C x H x W tensor (0-255) and an int class
index. Batches stay uint8 through collate and transfer; the engine converts them to
float and normalises them on the device with `DATASET_STATS`, after every batch
transform (`slipstream.to_unit_float` gives a plugin float pixels in [0, 1]).

Data sources are plugins (entry-point group ``slipstream.datasets``, base class
:class:`DatasetPlugin`). Names are imported on first use, so listing the installed
plugins does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DATASET_NAMES": "stats",
    "DATASET_STATS": "stats",
    "DataError": "datasets",
    "build_datasets": "datasets",
    "read_rgb": "datasets",
    "build_loader": "loaders",
    "set_output_size": "loaders",
    "stack_images": "gpu_decode",
    "device_batches": "gpu_decode",
    "output_size_of": "loaders",
    "EpochSampler": "sampler",
    "SyntheticShapes": "synthetic",
    "DatasetPlugin": "sources",
    "DataRequest": "sources",
    "BuiltData": "sources",
    "DATASETS_GROUP": "sources",
    "build_dataset_plugin": "sources",
    "decode_rgb": "decode",
    "ResizeCrop": "decode",
    "Geometry": "geometry",
    "sample_key": "geometry",
    "SampleKey": "sampler",
    "SkipLog": "decode",
    "ImageArray": "datasets",
    "StreamLoader": "stream",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'slipstream.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
