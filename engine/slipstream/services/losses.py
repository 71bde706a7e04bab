"""The per-batch losses a service keeps between two reads: references to the
device scalars, stacked into one vector when read, so the loop never waits for the
device in between and a read costs one pass, not one per batch."""

from __future__ import annotations

import torch


def stack_losses(losses: list[torch.Tensor]) -> torch.Tensor:
    """The losses as one float vector, on their device (no sync).

    One ``stack`` (dtypes promote, so bf16 and fp32 losses mix); a per-loss reshape
    only when their shapes differ (a loss function returning ``()`` for some batches
    and ``(1,)`` for others), which costs some microseconds a loss.
    """
    try:
        return torch.stack(losses).float().reshape(len(losses))
    except RuntimeError:
        return torch.stack([loss.float().reshape(()) for loss in losses])
