"""Moving a batch to the device."""

from __future__ import annotations

from typing import Any

import torch


def to_device(batch: Any, device: torch.device) -> Any:
    non_blocking = device.type == "cuda"
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        return tuple(to_device(item, device) for item in batch)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    return batch
