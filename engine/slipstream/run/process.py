"""The process set-up of a run: device, threads, determinism, process group and seed.

Made once per run, before its data and model are built (so both are built seeded):
by the command line before it builds them, or by a :class:`~slipstream.Trainer` made
in Python that was not handed one. The settings are process-wide, as torch's are.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
import torch

from slipstream.config.options import TrainerOptions
from slipstream.distributed import init_distributed, resolve_device


@dataclass(frozen=True)
class Process:
    """Where this process trains and its place among the run's processes."""

    device: torch.device
    rank: int = 0
    world_size: int = 1


def set_up_process(options: TrainerOptions) -> Process:
    """Apply ``options``' process-wide settings (validated before), seed what is built
    next, and join the process group torchrun describes, if any."""
    device = options.device if isinstance(options.device, torch.device) else resolve_device(options.device)
    apply_process_settings(options, device)
    seed_everything(options.seed)
    rank, world_size = init_distributed(device)
    return Process(device, rank, world_size)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (every device) from one number."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def apply_process_settings(options: TrainerOptions, device: torch.device | None = None) -> None:
    """Threads and determinism, as ``options`` say."""
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    if options.deterministic:
        if device is not None and device.type == "cuda":
            # cuBLAS is deterministic only with a fixed workspace; set it before the
            # first cuBLAS call, unless the user chose one.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            # torch flags adaptive average pooling's CUDA backward as nondeterministic and
            # would refuse every timm and torchvision CNN (their global pool) at the first
            # step; at a 1x1 output its atomic adds never meet, so the result is exact.
            # torch still warns, naming any op that has no deterministic kernel.
            torch.use_deterministic_algorithms(True, warn_only=True)
        else:
            # Only switched on: turning it off here would undo a user's own global choice.
            torch.use_deterministic_algorithms(True)
