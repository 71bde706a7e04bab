"""build_loader: a DataLoader whose batches depend only on (seed, epoch, start_batch);
stop_workers: end a loader's persistent worker processes."""

from __future__ import annotations

import random
from collections.abc import Sequence

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
    # data.decode=gpu or auto: its items may be JPEG bytes, decoded on the GPU per batch.
    switch = getattr(getattr(dataset, "geometry", None), "switch", None)
    cls = DataLoader
    if switch is not None:
        from slipstream.data.gpu_decode import DeviceDecodingLoader, collate

        cls, extra = DeviceDecodingLoader, {"collate_fn": collate}
    else:
        extra = {}
    return cls(
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
        **extra,
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


def set_output_size(loader: object, size: int | Sequence[int] | None) -> bool:
    """Tell ``loader`` the side of the images it cuts from the next ``iter`` on (an
    epoch): its workers decode small crops directly instead of full ones that are shrunk
    later (FFCV's progressive resizing). ``size``: one side for the epoch, or one per
    global batch of the epoch (0 or None: the images' own size).

    True where the loader can: a :func:`build_loader` loader whose sampler gives keys
    (its items are cut per sample by a geometry: ImageFolder trees, Hugging Face tables,
    random crops of in-memory images); the keys carry each batch's size to the workers,
    persistent ones too. A :class:`~slipstream.data.stream.StreamLoader` over a source cut
    by a geometry (WebDataset shards) starts its workers each epoch with one size: the
    largest of those given (the caller shrinks the smaller batches). False for anything
    else (the caller resizes the batches itself)."""
    setter = getattr(loader, "set_output_size", None)
    if callable(setter):
        return bool(setter(size))
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, EpochSampler) or not sampler.keyed:
        return False
    sampler.output_size = int(size or 0) if size is None or isinstance(size, int) else [int(s or 0) for s in size]
    return True


def output_size_of(loader: object) -> int | None:
    """The side of the images ``loader`` cuts when it is told none (its geometry's size);
    None where it cuts none (see :func:`set_output_size`)."""
    # A stream's own (its source's is the epoch's, where it reads in this process).
    geometry = getattr(loader, "geometry", None) or getattr(getattr(loader, "dataset", None), "geometry", None)
    return getattr(geometry, "size", None)
