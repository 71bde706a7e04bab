"""Per-batch seeds: randomness that depends on the run's seed and the batch alone, so a
run resumed mid-epoch draws the same numbers with no generator state to checkpoint."""

from __future__ import annotations

import hashlib


def batch_seed(seed: int, rank: int, batch: int, stream: str = "") -> int:
    """A 64-bit seed for one batch of one rank, stable across processes and runs.

    ``stream`` names the consumer (``"mixup"``), so that two plugins seeded for the
    same batch draw independent numbers; the empty stream is the historical one.
    """
    key = f"{seed}/{rank}/{batch}" + (f"/{stream}" if stream else "")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
