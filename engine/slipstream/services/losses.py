"""The per-batch losses a service keeps between two reads: references to the
device scalars, stacked into one vector when read, so the loop never waits for the
device in between and a read costs one pass, not one per batch."""

from __future__ import annotations

import torch


def stack_losses(losses: list[torch.Tensor]) -> torch.Tensor:
    """The losses as one float vector, on their device (no sync).

    One ``stack`` for the common case (scalar losses of one dtype); a per-loss
    reshape only when a loss function returned them otherwise (shape ``(1,)``, or
    mixed dtypes under a precision plugin), which costs some microseconds a loss.
    """
    try:
        return torch.stack(losses).float().reshape(len(losses))
    except RuntimeError:
        return torch.stack([loss.float().reshape(()) for loss in losses])
