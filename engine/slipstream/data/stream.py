"""StreamLoader: deterministic, resumable, rank- and worker-split batches from shards
that are read front to back (WebDataset tars, or anything streamed).

The epoch's sample order is a function of (seed, epoch) alone:

- the shards are permuted (when shuffling);
- inside each shard, consecutive blocks of ``shuffle_block`` samples are permuted;
- the resulting sequence of N samples is cut into ``world_size`` contiguous ranges,
  one per rank, so each rank reads only its own shards (plus at most a part of a
  shard at either end of its range);
- a rank's batches are split among its loader workers as contiguous runs, and the
  loader's round-robin over workers gives batch ``p`` of the epoch to worker
  ``p % num_workers``.

So every sample is read once per epoch across all processes and workers, and a run
resumed at batch ``s`` asks each worker for the batches the interrupted run had not
reached: the worker that yields batch ``s + w`` starts ``((s + w) // num_workers)``
batches into the run of worker ``(s + w) % num_workers``. The cost of resuming is
reading (not decoding) the samples of a shard before the first one needed, at most
one shard per worker. Exact resume needs the same world size and num_workers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from slipstream.data.datasets import DataError
from slipstream.data.decode import SkipLog
from slipstream.data.gpu_decode import device_batches, stack_images
from slipstream.data.sampler import epoch_seed


class ShardSource(Protocol):
    """What a streamed data source provides to :class:`StreamLoader`."""

    shard_sizes: Sequence[int]  # samples per shard, known before the epoch starts

    def shard_name(self, shard: int) -> str: ...

    def read(self, shard: int, start: int, stop: int) -> Iterator[Any]:
        """The raw samples ``start`` .. ``stop - 1`` of ``shard``, in stored order."""
        ...

    def decode(self, raw: Any) -> tuple[torch.Tensor, int]:
        """A raw sample as (uint8 C x H x W at the run's size, label); a DataError
        for one that cannot be read (it is skipped and named)."""
        ...

    def sample_name(self, raw: Any) -> str: ...


def _rank_range(total: int, rank: int, world_size: int) -> tuple[int, int]:
    return total * rank // world_size, total * (rank + 1) // world_size


def worker_runs(batches: int, workers: int) -> list[tuple[int, int]]:
    """Each worker's contiguous run of batch contents: (first, count); worker ``o``
    yields positions ``o, o + workers, ...``, and position ``p`` holds content
    ``first_o + p // workers``."""
    runs, first = [], 0
    for o in range(workers):
        count = max(0, (batches - o + workers - 1) // workers)
        runs.append((first, count))
        first += count
    return runs


class _EpochStream(IterableDataset):
    def __init__(self, source: ShardSource, loader: StreamLoader) -> None:
        self.source = source
        self.batch_size = loader.batch_size
        self.seed = loader.seed
        self.shuffle = loader.shuffle
        self.block = loader.shuffle_block
        self.rank = loader.rank
        self.world_size = loader.world_size
        self.drop_last = loader.drop_last
        self.epoch = loader.epoch
        self.start_batch = loader.start_batch
        self.workers = max(1, loader.num_workers)
        self.replace = loader.replace_unreadable
        # The source's cut at the size an image-size curriculum told the loader for this
        # epoch (the workers are started per epoch, so they get it with the layout).
        self.geometry = loader.epoch_geometry()
        # (name, reason) of the unreadable samples met since the last batch: they travel
        # with the next batch to the loader's log in the main process, which names each
        # once and stops at its cap for the whole run (a worker's own log would start
        # afresh every epoch, as the workers do).
        self.skipped: list[tuple[str, str]] = []

    # -- the epoch's layout ---------------------------------------------------------
    def shard_order(self) -> list[int]:
        n = len(self.source.shard_sizes)
        if not self.shuffle:
            return list(range(n))
        return [int(i) for i in np.random.default_rng(epoch_seed(self.seed, self.epoch)).permutation(n)]

    def block_perm(self, shard: int, block: int, length: int) -> np.ndarray:
        words = [self.seed % (1 << 64), self.epoch, shard, block]
        return np.random.default_rng(np.random.SeedSequence(words)).permutation(length)

    def pieces(self, first: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """(shard, start, stop) pieces of the epoch's global positions [first, stop)."""
        offset = 0
        for shard in self.shard_order():
            size = self.source.shard_sizes[shard]
            lo, hi = max(first, offset), min(stop, offset + size)
            if lo < hi:
                yield shard, lo - offset, hi - offset
            offset += size
            if offset >= stop:
                return

    def raw_samples(self, first: int, stop: int) -> Iterator[Any]:
        for shard, lo, hi in self.pieces(first, stop):
            if not self.shuffle or self.block <= 1:
                yield from self.source.read(shard, lo, hi)
                continue
            size = self.source.shard_sizes[shard]
            b0 = lo // self.block
            stream = self.source.read(shard, b0 * self.block, min(size, ((hi - 1) // self.block + 1) * self.block))
            for b in range(b0, (hi - 1) // self.block + 1):
                bs, be = b * self.block, min(size, (b + 1) * self.block)
                held = [next(stream) for _ in range(be - bs)]
                perm = self.block_perm(shard, b, be - bs)
                for j in range(max(lo, bs), min(hi, be)):
                    yield held[perm[j - bs]]

    def decoded(self, raws: Iterator[Any]) -> Iterator[tuple[torch.Tensor, int]]:
        """Decoded samples; an unreadable one is named and replaced by the next readable
        one (the last one at the end of the stream), so batch counts never change. An
        evaluation's stream (``replace_unreadable=False``) leaves it out instead: a
        stand-in would be counted twice, in the accuracy and in the samples."""
        pending, last = 0, None
        for raw in raws:
            try:
                item = self.source.decode(raw)
            except DataError as err:
                self.skipped.append((self.source.sample_name(raw), str(err)))
                if self.replace:
                    pending += 1
                continue
            for _ in range(pending + 1):
                yield item
            pending, last = 0, item
        if pending:
            if last is None:
                raise DataError(f"none of the {pending} samples this loader worker read can be decoded")
            for _ in range(pending):
                yield last

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        w = info.id if info is not None else 0
        if hasattr(self.source, "set_epoch"):  # a source whose random crops are per (sample, epoch)
            self.source.set_epoch(self.epoch)
        if self.geometry is not None:
            self.source.geometry = self.geometry
        total = sum(self.source.shard_sizes)
        r0, r1 = _rank_range(total, self.rank, self.world_size)
        batches = batches_for(r1 - r0, self.batch_size, self.drop_last, total, self.world_size)
        s = self.start_batch
        if s + w >= batches:
            return
        origin = (s + w) % self.workers
        first, count = worker_runs(batches, self.workers)[origin]
        start_content = first + (s + w) // self.workers
        end_content = first + count
        a = r0 + start_content * self.batch_size
        b = min(r1, r0 + end_content * self.batch_size)
        images: list[torch.Tensor] = []
        labels: list[int] = []
        for image, label in self.decoded(self.raw_samples(a, b)):
            images.append(image)
            labels.append(label)
            if len(images) == self.batch_size:
                yield stack_images(images), torch.tensor(labels, dtype=torch.int64), self._take_skipped()
                images, labels = [], []
        if images:
            yield stack_images(images), torch.tensor(labels, dtype=torch.int64), self._take_skipped()
        elif self.skipped:  # met after the last batch: no batch, only their names
            yield None, None, self._take_skipped()

    def _take_skipped(self) -> list[tuple[str, str]]:
        taken, self.skipped = self.skipped, []
        return taken


def batches_for(length: int, batch_size: int, drop_last: bool, total: int, world_size: int) -> int:
    """A rank's batches per epoch: with drop_last, the same on every rank (what DDP needs)."""
    if drop_last:
        return (total // world_size) // batch_size
    return -(-length // batch_size)


class StreamLoader:
    """Batches of ``(uint8 N x C x H x W, int64 N)`` from a :class:`ShardSource`.

    Quacks like Slipstream's map-style loaders where the Trainer looks:
    ``loader.sampler.set_epoch(epoch, start_batch)``, ``sampler.batches_per_epoch``,
    ``batch_size`` and ``len()``. Workers are started per epoch (the epoch's layout
    travels to them), so ``persistent_workers`` does not apply.
    """

    def __init__(
        self,
        source: ShardSource,
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        shuffle_block: int = 256,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        pin_memory: bool = False,
        drop_last: bool = True,
        replace_unreadable: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {batch_size}")
        self.source = source
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.shuffle_block = shuffle_block
        self.rank = rank
        self.world_size = world_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.drop_last = drop_last
        self.epoch = 0
        self.start_batch = 0
        self.num_samples = int(sum(source.shard_sizes))
        self.dataset = source
        # Training replaces an unreadable sample with the next one (batch counts stay);
        # an evaluation leaves it out (a stand-in would be counted twice).
        self.replace_unreadable = replace_unreadable
        self.skips = SkipLog("shard" if replace_unreadable else None)  # the whole run's, in this process
        # The source's own cut, and the side an image-size curriculum told for the epoch
        # (set_output_size; 0: the cut's own size).
        self.geometry = getattr(source, "geometry", None)
        self.output_size = 0

    # Its batches are split among its workers (see the module's docstring): a resume
    # with another data.num_workers does not continue the order the run had.
    order_depends_on_workers = True

    @property
    def sampler(self) -> StreamLoader:
        return self

    @property
    def batches_per_epoch(self) -> int:
        r0, r1 = _rank_range(self.num_samples, self.rank, self.world_size)
        return batches_for(r1 - r0, self.batch_size, self.drop_last, self.num_samples, self.world_size)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        if not 0 <= start_batch <= self.batches_per_epoch:
            raise ValueError(f"start_batch must be in [0, {self.batches_per_epoch}]; got {start_batch}")
        self.epoch = epoch
        self.start_batch = start_batch

    def __len__(self) -> int:
        return self.batches_per_epoch - self.start_batch

    def set_output_size(self, size: int | Sequence[int] | None) -> bool:
        """Cut this epoch's images (from the next ``iter``) to ``size`` px (None or 0: the
        cut's own; one per batch: the largest, since the workers start with one size);
        False where the source's images are not cut by a geometry."""
        if self.geometry is None:
            return False
        sizes = [size] if size is None or isinstance(size, int) else list(size)
        self.output_size = 0 if not sizes or 0 in sizes or None in sizes else int(max(sizes))
        return True

    def epoch_geometry(self) -> Any:
        """The geometry of the epoch: the source's own, at the size told, if any."""
        if self.geometry is None:
            return None
        return self.geometry.at(self.output_size) if self.output_size else self.geometry

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        loader = DataLoader(
            _EpochStream(self.source, self),
            batch_size=None,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
        )
        self.start_batch = 0  # the stream above keeps it: a resume applies to one epoch only
        return device_batches(self._logged(_one_line_errors(iter(loader))))

    def _logged(self, batches: Iterator[Any]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches, the unreadable samples that came with each named in this
        process's log (once each, at most MAX_NAMED for the run)."""
        for images, labels, skipped in batches:
            for name, reason in skipped:
                self.skips.warn(name, reason)
            if images is not None:
                yield images, labels


def _one_line_errors(batches: Iterator[Any]) -> Iterator[Any]:
    """A DataError raised in a loader worker arrives with the worker's traceback in its
    message; the user needs its last line only."""
    try:
        yield from batches
    except DataError as err:
        lines = [line for line in str(err).splitlines() if line.strip()]
        last = lines[-1] if lines else ""
        raise DataError(last.split("DataError: ", 1)[-1]) from None
