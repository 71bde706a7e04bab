"""Devices and torch.distributed: CUDA when present, CPU otherwise; several
processes only when launched by torchrun (no launcher of our own)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from slipstream.duration import Duration


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


def shared_clock(state: Any, options: Any) -> Any:
    """Across processes, a run that the wall clock ends (or evaluates, or checkpoints)
    must decide by one clock: each rank's own would let one rank stop or evaluate a
    batch before another, which then waits for it in a collective for ever. The function
    returned is called each batch: the ranks agree on the latest of their clocks (one
    all-reduce of a number). None for other runs (``options``: the run's TrainerOptions)."""
    if state.world_size <= 1 or not _wall_clock_decides(state.max_duration, options):
        return None
    device = state.device if state.device.type == "cuda" else torch.device("cpu")

    def share(state: Any) -> None:
        clock = torch.tensor([state.tick()], dtype=torch.float64, device=device)
        dist.all_reduce(clock, op=dist.ReduceOp.MAX)
        state.timestamp.elapsed_s = float(clock.item())

    # From here until the loop ends, the run decides by the agreed time only (the
    # metrics log's and progress bar's own ticks must not move it on one rank).
    state.shared_clock = True
    return share


def _wall_clock_decides(max_duration: Any, options: Any) -> bool:
    if max_duration.unit == "s":
        return True  # "dur" intervals and schedules then follow the clock too
    for value in (options.eval_interval, options.checkpoint_interval):
        try:
            if value is not None and Duration.parse(value).unit == "s":
                return True
        except (ValueError, TypeError):
            continue
    return False
