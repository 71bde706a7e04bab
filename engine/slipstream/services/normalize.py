"""Normalise inputs on the device, after every batch transform.

Datasets yield images in [0, 1] so that augmentation plugins see real colours;
normalising last (``trylast``) keeps that true whatever plugins are enabled.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..hookspecs import hookimpl
from ..state import State


class Normalize:
    name = "engine.normalize"

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)

    def _apply(self, state: State) -> None:
        inputs, *rest = state.batch
        if self.mean.device != inputs.device:
            self.mean, self.std = self.mean.to(inputs.device), self.std.to(inputs.device)
        # Out of place: elementwise ops keep the input's memory format.
        state.batch = ((inputs - self.mean) / self.std, *rest)

    @hookimpl(trylast=True)
    def batch_start(self, state: State) -> None:
        self._apply(state)

    @hookimpl(trylast=True)
    def eval_batch_start(self, state: State) -> None:
        self._apply(state)
