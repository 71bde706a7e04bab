"""An example third-party dataset plugin: images and labels from two .npz files.

Each file holds ``images`` (N x H x W x 3 uint8) and ``labels`` (N integers). The
plugin declares its keys (``data.file``, ``data.eval_file``) in a dataclass, and
returns map-style datasets of ``(uint8 3 x H x W, int)``: the engine wraps them in
its deterministic, rank-aware, resumable loaders and normalises on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from slipstream.data import DataError, DataRequest, DatasetPlugin, ImageArray


@dataclass
class NpzConfig:
    file: Optional[str] = None  # the training images
    eval_file: Optional[str] = None  # the evaluation images


def _read(path: Optional[str], key: str, image_size: int) -> tuple[Dataset, int]:
    if not path:
        raise DataError(f"npz needs data.{key}: an .npz file with 'images' (N x H x W x 3 uint8) and 'labels'")
    try:
        with np.load(path) as npz:
            images, labels = npz["images"], npz["labels"]
    except (OSError, KeyError, ValueError) as err:
        raise DataError(f"data.{key}={path}: {err}") from None
    if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
        raise DataError(f"data.{key}={path}: 'images' must be N x H x W x 3 uint8, got {images.shape} {images.dtype}")
    tensor = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()
    classes = int(labels.max()) + 1 if len(labels) else 0
    return ImageArray(tensor, labels.tolist(), [str(c) for c in range(classes)], image_size), classes


class NpzImages(DatasetPlugin):
    """Images and labels from .npz files (data.file, data.eval_file)."""

    name = "npz"
    config_class = NpzConfig
    stats = None  # not normalised unless a plugin knows its mean/std

    def datasets(self, request: DataRequest) -> tuple[Any, Any, int]:
        train, train_classes = _read(self.config.file, "file", request.image_size)
        val, val_classes = _read(self.config.eval_file, "eval_file", request.image_size)
        return train, val, max(train_classes, val_classes)
