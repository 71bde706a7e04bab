"""EpochSampler: a sample order that is a function of (seed, epoch) alone.

One permutation per epoch is cut into *global* batches of `batch_size * world_size`
samples; rank r takes the contiguous slice `[r * batch_size, (r + 1) * batch_size)` of
each global batch. So the samples in global batch i are the same at any world size, and
resuming at global batch k is just starting the same order k batches in.

With ``repeats`` R > 1 (repeated augmentation: DeiT's RASampler, timm's
``RepeatAugSampler``), each position of the permutation is taken R times in a row and the
order is cut to the dataset's size, so an epoch is as long as without repeats and holds
about ``num_samples / R`` distinct samples, R times each. Rank r then takes every
``world_size``-th position of each global batch from the r-th, so the R copies of a sample,
adjacent in the order, go to different ranks (DeiT's split); each copy's key carries its
repeat index, so each is cropped differently.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
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
    """A sample's index that carries the epoch it is read in and which of its repeats
    this is (what a sampler built with ``keyed=True`` yields): an ``int`` to every
    dataset, and the seed of its random crop to one that asks. ``size``: the output size
    the loader was told for its batch (an image-size curriculum's), 0 where none was."""

    epoch: int
    repeat: int
    size: int

    def __new__(cls, index: int, epoch: int = 0, repeat: int = 0, size: int = 0) -> SampleKey:
        key = super().__new__(cls, index)
        key.epoch = epoch
        key.repeat = repeat
        key.size = size
        return key

    def __reduce__(self) -> tuple[Any, ...]:  # to a worker and back, all it carries included
        return SampleKey, (int(self), self.epoch, self.repeat, self.size)


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
        keyed: yield :class:`SampleKey` s (index, epoch, repeat) rather than ints.
        repeats: how many times in a row each sample of the permutation is taken
            (repeated augmentation); 1: each sample once per epoch.

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
        repeats: int = 1,
    ) -> None:
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0; got {num_samples}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need 0 <= rank < world_size; got rank={rank}, world_size={world_size}"
            )
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be a whole number >= 1; got {repeats!r}")
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
        self.repeats = repeats
        # The images' side in this epoch, told by an image-size curriculum
        # (slipstream.data.loaders.set_output_size): one int, or one per global batch of
        # the epoch; 0: the geometry's own. It travels in the keys, so persistent
        # workers learn it with each sample.
        self.output_size: int | Sequence[int] = 0
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
        """The full global order of the current epoch (with ``repeats``, each sample
        ``repeats`` times in a row, cut to ``num_samples`` positions)."""
        if not self.shuffle:
            order = torch.arange(self.num_samples)
        else:
            gen = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
            order = torch.randperm(self.num_samples, generator=gen)
        if self.repeats > 1:
            # Only the first num_samples / repeats samples are needed (timm's
            # RepeatAugSampler takes the same prefix of the same repeated order).
            kept = -(-self.num_samples // self.repeats)
            order = order[:kept].repeat_interleave(self.repeats)[: self.num_samples]
        return order

    def _rank_positions(self, batch_index: int) -> range:
        """This rank's positions in the order of global batch `batch_index`."""
        begin = batch_index * self.global_batch_size
        size = min(self.global_batch_size, self.num_samples - begin)
        if self.repeats > 1:
            # Strided, as DeiT splits: a sample's repeats (adjacent) go to different
            # ranks, and a partial last batch still gives the lowest ranks one more.
            return range(begin + self.rank, begin + size, self.world_size)
        if size == self.global_batch_size:
            lo = begin + self.rank * self.batch_size
            return range(lo, lo + self.batch_size)
        # Partial last batch: even contiguous split, remainder to the lowest ranks.
        base, extra = divmod(size, self.world_size)
        lo = begin + self.rank * base + min(self.rank, extra)
        return range(lo, lo + base + (1 if self.rank < extra else 0))

    def __iter__(self) -> Iterator[int]:
        order = self.permutation()
        repeats, epoch, sizes = self.repeats, self.epoch, self.output_size
        for b in range(self.start_batch, self.batches_per_epoch):
            size = sizes if isinstance(sizes, int) else (sizes[b] if b < len(sizes) else 0)
            at = self._rank_positions(b)
            indices = order[at.start : at.stop : at.step].tolist()
            if not self.keyed:
                yield from indices
            elif repeats > 1:
                # The repeat index is the position's place in its run of repeats.
                yield from (SampleKey(i, epoch, p % repeats, size) for i, p in zip(indices, at, strict=True))
            else:
                yield from (SampleKey(i, epoch, 0, size) for i in indices)

    def __len__(self) -> int:
        full = self.num_samples // self.global_batch_size
        total = max(0, full - self.start_batch) * self.batch_size
        if self.batches_per_epoch > full and self.start_batch <= full:
            total += len(self._rank_positions(full))
        return total

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "start_batch": self.start_batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.set_epoch(state["epoch"], state.get("start_batch", 0))
