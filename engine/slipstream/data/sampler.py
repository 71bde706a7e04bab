"""EpochSampler: a sample order that is a function of (seed, epoch) alone.

One permutation per epoch is cut into *global* batches of `batch_size * world_size`
samples; rank r takes the contiguous slice `[r * batch_size, (r + 1) * batch_size)` of
each global batch. So the samples in global batch i are the same at any world size, and
resuming at global batch k is just starting the same order k batches in.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler


def epoch_seed(seed: int, epoch: int) -> int:
    """Mix (seed, epoch) into one 63-bit seed.

    A hash rather than `seed + epoch`, so that (seed=0, epoch=1) and (seed=1, epoch=0)
    do not share an order.
    """
    words = [seed % (1 << 64), epoch % (1 << 64)]
    state = np.random.SeedSequence(words).generate_state(2, dtype=np.uint32)
    return ((int(state[0]) << 32) | int(state[1])) & ((1 << 63) - 1)


class SampleKey(int):
    """A sample's index that carries the epoch it is read in (what a sampler built with
    ``keyed=True`` yields): an ``int`` to every dataset, and the seed of its random crop
    to one that asks."""

    epoch: int

    def __new__(cls, index: int, epoch: int = 0) -> SampleKey:
        key = super().__new__(cls, index)
        key.epoch = epoch
        return key

    def __reduce__(self) -> tuple[Any, ...]:  # to a worker and back, epoch included
        return SampleKey, (int(self), self.epoch)


class EpochSampler(Sampler[int]):
    """Deterministic, resumable, rank-aware sampler.

    Args:
        num_samples: size of the dataset.
        batch_size: samples per batch *per process*.
        seed: with the epoch, the only input to the order.
        shuffle: permute each epoch; otherwise the identity order.
        rank, world_size: this process's slice of each global batch.
        drop_last: drop the final partial global batch. When False, that batch
            (m samples) is split into `world_size` contiguous chunks as evenly as
            possible: the first `m % world_size` ranks get one sample more, and ranks
            may get none when m < world_size. Per-rank batch counts can then differ by
            one, which DDP must tolerate (e.g. with `join`); training usually keeps the
            default drop_last=True, evaluation uses False.

    Call `set_epoch(epoch, start_batch)` before each epoch (before `iter(loader)`).
    """

    def __init__(
        self,
        num_samples: int,
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        keyed: bool = False,
    ) -> None:
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0; got {num_samples}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need 0 <= rank < world_size; got rank={rank}, world_size={world_size}"
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        # Indices as SampleKeys that carry the epoch (a dataset with per-sample random
        # crops seeds them from it, in whichever worker reads the sample).
        self.keyed = keyed
        self.epoch = 0
        self.start_batch = 0
        # The loader draws its workers' base seed from this generator when an iterator is
        # created; reseeding it in set_epoch makes worker RNG a function of (seed, epoch).
        self.generator = torch.Generator()
        self.set_epoch(0)

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    @property
    def batches_per_epoch(self) -> int:
        """Global batches in a full epoch (including a final partial one if kept)."""
        full, rest = divmod(self.num_samples, self.global_batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select the epoch's order, and start from global batch `start_batch` (resume)."""
        if not 0 <= start_batch <= self.batches_per_epoch:
            raise ValueError(
                f"start_batch must be in [0, {self.batches_per_epoch}]; got {start_batch}"
            )
        self.epoch = epoch
        self.start_batch = start_batch
        self.generator.manual_seed(epoch_seed(self.seed, epoch) ^ 0x5EED)

    def permutation(self) -> torch.Tensor:
        """The full global order of the current epoch."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        gen = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
        return torch.randperm(self.num_samples, generator=gen)

    def _rank_slice(self, batch_index: int) -> tuple[int, int]:
        """[start, stop) of this rank's samples of global batch `batch_index` in the order."""
        begin = batch_index * self.global_batch_size
        size = min(self.global_batch_size, self.num_samples - begin)
        if size == self.global_batch_size:
            lo = begin + self.rank * self.batch_size
            return lo, lo + self.batch_size
        # Partial last batch: even contiguous split, remainder to the lowest ranks.
        base, extra = divmod(size, self.world_size)
        lo = begin + self.rank * base + min(self.rank, extra)
        return lo, lo + base + (1 if self.rank < extra else 0)

    def __iter__(self) -> Iterator[int]:
        order = self.permutation()
        for b in range(self.start_batch, self.batches_per_epoch):
            lo, hi = self._rank_slice(b)
            if self.keyed:
                yield from (SampleKey(i, self.epoch) for i in order[lo:hi].tolist())
            else:
                yield from order[lo:hi].tolist()

    def __len__(self) -> int:
        full = self.num_samples // self.global_batch_size
        total = max(0, full - self.start_batch) * self.batch_size
        if self.batches_per_epoch > full and self.start_batch <= full:
            lo, hi = self._rank_slice(full)
            total += hi - lo
        return total

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "start_batch": self.start_batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.set_epoch(state["epoch"], state.get("start_batch", 0))
