"""Per-batch seeds: one random stream per training batch and rank, for plugins that
draw random numbers while transforming a batch (augmentations, random crops).

A seed derived from ``(run seed, rank, batch index)`` alone makes a plugin's random
choices independent of everything else that consumes random numbers, so the same
seed gives the same batches, ranks differ from one another, and a resumed run
(mid-epoch included) draws exactly what the uninterrupted run drew.
"""

from __future__ import annotations

import hashlib

import torch

from slipstream.state import State


def batch_seed(seed: int, rank: int, batch: int, stream: str = "") -> int:
    """A 64-bit seed for one batch of one rank, stable across processes, runs and
    Python versions (a hash of the three numbers, not Python's ``hash``).

    ``stream`` names the consumer (``"mixup"``), so that two plugins seeded for the
    same batch draw independent numbers; the empty stream is the historical one.

    >>> batch_seed(0, 0, 5) == batch_seed(0, 0, 5), batch_seed(0, 0, 5) == batch_seed(0, 1, 5)
    (True, False)
    >>> batch_seed(0, 0, 5) == batch_seed(0, 0, 5, "mixup")
    False
    """
    key = f"{seed}/{rank}/{batch}" + (f"/{stream}" if stream else "")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def batch_generator(state: State, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded for the current training batch of
    this rank (:func:`batch_seed` of ``state.seed``, ``state.rank`` and the batch
    index), for drawing with ``generator=``."""
    seed = batch_seed(state.seed, state.rank, state.timestamp.batch)
    return torch.Generator(device=device).manual_seed(seed)
