"""build_loader: a DataLoader whose batches depend only on (seed, epoch, start_batch);
stop_workers: end a loader's persistent worker processes."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from slipstream.data.sampler import EpochSampler


def seed_worker(worker_id: int) -> None:
    """Seed Python's and NumPy's RNGs in a worker from the seed torch gave it.

    torch seeds each worker with `base_seed + worker_id`, and `base_seed` is drawn from
    the loader's generator, which `EpochSampler.set_epoch` reseeds from (seed, epoch).
    Seeding the other libraries here (recent torch does too) keeps any random transform
    reproducible whatever the torch version.
    """
    seed = torch.initial_seed() % (1 << 32)
    random.seed(seed)
    np.random.seed(seed)


def build_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    seed: int = 0,
    shuffle: bool = True,
    rank: int = 0,
    world_size: int = 1,
    num_workers: int = 0,
    pin_memory: bool = False,
    persistent_workers: bool = False,
    drop_last: bool = True,
    repeats: int = 1,
) -> DataLoader:
    """A DataLoader over `dataset` driven by an `EpochSampler` (`loader.sampler`).

    Call `loader.sampler.set_epoch(epoch, start_batch)` before iterating each epoch.
    For evaluation pass `shuffle=False, drop_last=False`. `repeats` > 1: repeated
    augmentation (each sample `repeats` times in an epoch of the same length, each copy
    keyed, so cropped, differently: see `EpochSampler`).

    With `persistent_workers`, workers (and their RNG) are created once, at the first
    epoch iterated; the built-in datasets draw no randomness per item, so their batches
    are still bit-exact on resume.
    """
    sampler = EpochSampler(
        len(dataset),
        batch_size=batch_size,
        seed=seed,
        shuffle=shuffle,
        rank=rank,
        world_size=world_size,
        drop_last=drop_last,
        keyed=bool(getattr(dataset, "keyed", False)),  # its samples' random crops need the epoch
        repeats=repeats,
    )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        # The sampler already drops (or splits) the last partial global batch.
        drop_last=False,
        num_workers=num_workers,
        # Pinning without CUDA only produces a warning per iterator.
        pin_memory=pin_memory and torch.cuda.is_available(),
        persistent_workers=persistent_workers and num_workers > 0,
        worker_init_fn=seed_worker if num_workers > 0 else None,
        generator=sampler.generator,
    )


def stop_workers(*loaders: object) -> None:
    """End the persistent worker processes of ``loaders`` (any object; those that are
    not DataLoaders with live workers are skipped); the next epoch would start new ones.

    Call it when the loaders' run is over. Left to the interpreter's exit, the workers
    were told to stop too late: on Python 3.12 the exit waited the 5 s join timeout for
    each of them, 40 s for two loaders of four workers on an H100 machine.
    """
    for loader in loaders:
        iterator = getattr(loader, "_iterator", None) if isinstance(loader, DataLoader) else None
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
            loader._iterator = None
