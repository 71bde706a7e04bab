"""Normalise inputs on the device, after every batch transform.

Not a hook implementation: the loop calls it explicitly once ``batch_start`` (or
``eval_batch_start``) has returned, so it comes after every plugin's transform,
``trylast`` ones included, and plugins always see real colours in [0, 1].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class Normalize:
    """``(inputs - mean) / std`` per channel on the first element of a batch.

    Without ``mean``/``std`` the batch passes through unchanged.
    """

    name = "engine.normalize"

    def __init__(
        self, mean: Sequence[float] | None = None, std: Sequence[float] | None = None
    ) -> None:
        if (mean is None) != (std is None):
            raise ValueError("normalize needs both mean and std, or neither")
        self.mean = None if mean is None else torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = None if std is None else torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)

    def __call__(self, batch: Any) -> Any:
        if self.mean is None or not isinstance(batch, (tuple, list)) or not batch:
            return batch
        inputs, *rest = batch
        if self.mean.device != inputs.device:
            self.mean, self.std = self.mean.to(inputs.device), self.std.to(inputs.device)
        # Out of place: elementwise ops keep the input's memory format.
        return ((inputs - self.mean) / self.std, *rest)
