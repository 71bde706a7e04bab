"""Devices and torch.distributed: CUDA when present, CPU otherwise; several
processes only when launched by torchrun (no launcher of our own)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def resolve_device(name: str | None = "auto") -> torch.device:
    name = name or "auto"
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        from slipstream.errors import ConfigError

        raise ConfigError(
            f"trainer.device={name!r} but CUDA is not available here; use 'cpu' or 'auto'"
        )
    return device


def init_distributed(device: torch.device) -> tuple[int, int]:
    """(rank, world_size). Joins the process group torchrun describes, if any."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return 0, 1
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def from_rank0(value: Any) -> Any:
    """``value`` as rank 0 has it, on every rank (a run directory named by the clock
    must be one directory on every node); ``value`` itself in one process."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
