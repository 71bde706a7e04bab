"""Tests for slipstream.data: synthetic rendering, dataset builders, sampler, loader."""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision import datasets as tv_datasets

from slipstream.data import (
    DATASET_NAMES,
    DATASET_STATS,
    DataError,
    EpochSampler,
    SyntheticShapes,
    build_datasets,
    build_loader,
)

torch.set_num_threads(1)


# --------------------------------------------------------------------------- synthetic


def test_synthetic_is_deterministic_across_instances() -> None:
    a = SyntheticShapes(12, image_size=32, seed=3)
    b = SyntheticShapes(12, image_size=32, seed=3)
    assert torch.equal(a.images, b.images)
    assert torch.equal(a.targets, b.targets)


def test_synthetic_sample_does_not_depend_on_dataset_size() -> None:
    small = SyntheticShapes(7, image_size=16, seed=1)
    large = SyntheticShapes(25, image_size=16, seed=1)
    assert torch.equal(small.images, large.images[:7])
    assert torch.equal(small.targets, large.targets[:7])


def test_a_large_synthetic_set_is_rendered_in_processes_with_the_same_pixels(monkeypatch) -> None:
    import os

    import slipstream.data.synthetic as synthetic

    sequential = SyntheticShapes(40, image_size=16, seed=5)
    children = []
    real = synthetic._render_range

    def recorded(*args):
        children.append(os.getpid())
        return real(*args)

    monkeypatch.setattr(synthetic, "_render_range", recorded)  # the children are forked: they see it
    monkeypatch.setattr(synthetic, "_processes_for", lambda size: 3)
    parallel = SyntheticShapes(40, image_size=16, seed=5)
    assert torch.equal(parallel.images, sequential.images)
    assert torch.equal(parallel.targets, sequential.targets)
    assert not children  # the forked processes rendered every sample, the parent none
    # Only large sets pay for processes; a small one renders where it is.
    monkeypatch.undo()
    assert synthetic._processes_for(synthetic.PARALLEL_MIN_SAMPLES - 1) == 1
    # A daemonic process (a DataLoader worker, say) may not have children: it renders alone.
    monkeypatch.setattr(synthetic.multiprocessing.current_process(), "daemon", True, raising=False)
    assert synthetic._processes_for(10 * synthetic.PARALLEL_MIN_SAMPLES) == 1


def test_synthetic_differs_across_splits_and_seeds() -> None:
    base = SyntheticShapes(10, image_size=16, seed=0, split="train")
    other_split = SyntheticShapes(10, image_size=16, seed=0, split="val")
    other_seed = SyntheticShapes(10, image_size=16, seed=1, split="train")
    for other in (other_split, other_seed):
        assert not torch.equal(base.images, other.images)
        # Not just a few pixels: no image of one appears in the other.
        assert all(not torch.equal(x, y) for x, y in zip(base.images, other.images, strict=True))


@pytest.mark.parametrize("image_size", [16, 32, 64])
def test_synthetic_items_shape_dtype_range(image_size: int) -> None:
    ds = SyntheticShapes(6, image_size=image_size)
    assert len(ds) == 6
    image, target = ds[0]
    assert image.shape == (3, image_size, image_size)
    assert image.dtype == torch.uint8  # converted to float on the device, once per batch
    assert isinstance(target, int) and 0 <= target < 10
    assert torch.equal(image, ds.images[0])


@pytest.mark.parametrize("num_classes", [2, 10, 20])
def test_synthetic_labels_balanced(num_classes: int) -> None:
    ds = SyntheticShapes(4 * num_classes, image_size=16, num_classes=num_classes)
    counts = torch.bincount(ds.targets, minlength=num_classes)
    assert counts.tolist() == [4] * num_classes
    assert len(ds.classes) == num_classes
    # Shuffled, not simply index % num_classes.
    assert ds.targets.tolist() != [i % num_classes for i in range(len(ds))]


@pytest.mark.parametrize("num_classes", [0, 1, 21])
def test_synthetic_rejects_bad_num_classes(num_classes: int) -> None:
    with pytest.raises(ValueError, match=r"num_classes from 2 to 20.*got " + str(num_classes)):
        SyntheticShapes(4, num_classes=num_classes)


def test_synthetic_rejects_bad_split() -> None:
    with pytest.raises(ValueError, match="split"):
        SyntheticShapes(4, split="test")


def test_synthetic_same_scene_at_every_resolution() -> None:
    lo = SyntheticShapes(16, image_size=32, seed=5).images.float() / 255
    hi = SyntheticShapes(16, image_size=64, seed=5).images.float() / 255
    down = F.avg_pool2d(hi, 2)
    # Pixel noise is drawn per resolution, so compare the same picture at 8 px where
    # the noise averages out, and against unrelated samples for scale.
    same = (F.avg_pool2d(lo, 4) - F.avg_pool2d(down, 4)).abs().mean().item()
    unrelated = (F.avg_pool2d(lo, 4) - F.avg_pool2d(down.roll(1, 0), 4)).abs().mean().item()
    assert same < 0.02
    assert unrelated > 5 * same
    assert (lo - down).abs().mean().item() < 0.06


def test_synthetic_stats_match_rendering() -> None:
    images = SyntheticShapes(400, image_size=16).images.float() / 255
    mean, std = DATASET_STATS["synthetic"]
    assert torch.allclose(images.mean((0, 2, 3)), torch.tensor(mean), atol=0.03)
    assert torch.allclose(images.std((0, 2, 3)), torch.tensor(std), atol=0.03)


# ------------------------------------------------------------------- build_datasets


def test_build_synthetic() -> None:
    train, val, n = build_datasets(
        "synthetic", image_size=16, num_classes=4, train_size=8, val_size=4, seed=2
    )
    assert (len(train), len(val), n) == (8, 4, 4)
    assert isinstance(train, SyntheticShapes) and train.split == "train" and val.split == "val"
    assert train[0][0].shape == (3, 16, 16)


def test_build_synthetic_bad_classes_is_data_error() -> None:
    with pytest.raises(DataError, match="num_classes"):
        build_datasets("synthetic", num_classes=50, train_size=2, val_size=2)


def test_unknown_dataset_lists_names() -> None:
    with pytest.raises(DataError) as info:
        build_datasets("mnist")
    for name in DATASET_NAMES:
        assert name in str(info.value)
    assert set(DATASET_STATS) == set(DATASET_NAMES)


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _write_pickle(path: Path, obj: object) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f)


def _fake_cifar10(root: Path, monkeypatch: pytest.MonkeyPatch, per_batch: int = 4) -> None:
    """Write cifar-10-batches-py in the real format and register the files' md5s.

    torchvision verifies every file against hard-coded md5s of the real archive, so the
    test points the class's file lists at the md5s of these fake files: the integrity
    check still runs, it just accepts our files.
    """
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        _write_pickle(
            folder / name,
            {
                "batch_label": name,
                "data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                "labels": rng.integers(0, 10, per_batch).tolist(),
                "filenames": [f"{name}_{i}.png" for i in range(per_batch)],
            },
        )
    _write_pickle(
        folder / "batches.meta",
        {
            "label_names": [f"class{i}" for i in range(10)],
            "num_cases_per_batch": per_batch,
        },
    )
    listed = [[n, _md5(folder / n)] for n in names]
    monkeypatch.setattr(tv_datasets.CIFAR10, "train_list", listed[:5])
    monkeypatch.setattr(tv_datasets.CIFAR10, "test_list", listed[5:])
    monkeypatch.setattr(
        tv_datasets.CIFAR10,
        "meta",
        {
            "filename": "batches.meta",
            "key": "label_names",
            "md5": _md5(folder / "batches.meta"),
        },
    )


def _fake_cifar100(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    for name, n in (("train", 6), ("test", 3)):
        _write_pickle(
            folder / name,
            {
                "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                "fine_labels": rng.integers(0, 100, n).tolist(),
                "coarse_labels": rng.integers(0, 20, n).tolist(),
            },
        )
    _write_pickle(
        folder / "meta",
        {
            "fine_label_names": [f"fine{i}" for i in range(100)],
            "coarse_label_names": [f"coarse{i}" for i in range(20)],
        },
    )
    monkeypatch.setattr(tv_datasets.CIFAR100, "train_list", [["train", _md5(folder / "train")]])
    monkeypatch.setattr(tv_datasets.CIFAR100, "test_list", [["test", _md5(folder / "test")]])
    monkeypatch.setattr(
        tv_datasets.CIFAR100,
        "meta",
        {
            "filename": "meta",
            "key": "fine_label_names",
            "md5": _md5(folder / "meta"),
        },
    )


def test_cifar10_from_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cifar10(tmp_path, monkeypatch)
    train, val, n = build_datasets("cifar10", root=tmp_path)
    assert (len(train), len(val), n) == (20, 4, 10)
    image, target = train[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.uint8
    assert isinstance(target, int)
    # The pixels are the stored bytes, in CHW order.
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_1", "rb") as f:
        raw = pickle.load(f)["data"][0].reshape(3, 32, 32)
    assert torch.equal(image, torch.from_numpy(raw))


def test_cifar10_resized(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cifar10(tmp_path, monkeypatch)
    train, _, _ = build_datasets("cifar10", root=tmp_path, image_size=48)
    assert train[0][0].shape == (3, 48, 48) and train[0][0].dtype == torch.uint8


def test_cifar100_from_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cifar100(tmp_path, monkeypatch)
    train, val, n = build_datasets("cifar100", root=tmp_path)
    assert (len(train), len(val), n) == (6, 3, 100)
    assert train[0][0].shape == (3, 32, 32)


@pytest.mark.parametrize(
    "name,folder", [("cifar10", "cifar-10-batches-py"), ("cifar100", "cifar-100-python")]
)
def test_cifar_missing_says_where_and_how(tmp_path: Path, name: str, folder: str) -> None:
    with pytest.raises(DataError) as info:
        build_datasets(name, root=tmp_path)
    message = str(info.value)
    assert str(tmp_path / folder) in message and "data.download=true" in message


def test_cifar_corrupted_is_data_error(tmp_path: Path) -> None:
    (tmp_path / "cifar-10-batches-py").mkdir()
    (tmp_path / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"junk")
    with pytest.raises(DataError, match="corrupted"):
        build_datasets("cifar10", root=tmp_path)


def test_cifar_files_made_another_way_are_told_apart_from_a_broken_download(tmp_path: Path) -> None:
    """Real-format CIFAR-10 files that are not the official ones (written here with
    pickle, md5s not registered) fail torchvision's check; the error says why and
    what loads them, not only to download again (which an offline user cannot)."""
    with pytest.MonkeyPatch.context() as patch:
        _fake_cifar10(tmp_path, patch)  # the md5s registered only inside this block
    with pytest.raises(DataError, match=r"md5 of the official archive.*data.name=imagefolder.*delete") as info:
        build_datasets("cifar10", root=tmp_path)
    assert "\n" not in str(info.value)


def test_cifar_needs_root() -> None:
    with pytest.raises(DataError, match="data.root"):
        build_datasets("cifar10")


def _image_tree(root: Path, classes: dict[str, int], size: tuple[int, int] = (40, 30)) -> None:
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for k, (cls, count) in enumerate(classes.items()):
            folder = root / split / cls
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
                ext = "png" if (i + k) % 2 else "jpg"
                Image.fromarray(pixels).save(folder / f"img{i}.{ext}")
            # A grayscale file: the loader must still give 3 channels.
            Image.fromarray(pixels[..., 0]).save(folder / "gray.png")


def test_imagefolder(tmp_path: Path) -> None:
    _image_tree(tmp_path, {"cat": 2, "dog": 3, "emu": 1})
    train, val, n = build_datasets("imagefolder", root=tmp_path, image_size=24)
    assert n == 3 and len(train) == len(val) == 9
    for i in (0, len(train) - 1):
        image, target = train[i]
        assert image.shape == (3, 24, 24) and image.dtype == torch.uint8
        assert 0 <= target < 3
    assert train.classes == ["cat", "dog", "emu"]


def test_imagefolder_missing_layout(tmp_path: Path) -> None:
    with pytest.raises(DataError) as info:
        build_datasets("imagefolder", root=tmp_path)
    message = str(info.value)
    assert str(tmp_path / "train") in message and "train/<class>/" in message
    assert "val/<class>/" in message


def test_imagefolder_class_mismatch(tmp_path: Path) -> None:
    _image_tree(tmp_path, {"a": 1, "b": 1})
    (tmp_path / "val" / "b").rename(tmp_path / "val" / "c")
    with pytest.raises(DataError, match="class folders differ"):
        build_datasets("imagefolder", root=tmp_path)


# -------------------------------------------------------------------------- sampler


def _global_batches(num_samples: int, batch_size: int, world_size: int, **kw) -> list[list[int]]:
    """Global batch i as the concatenation of every rank's i-th batch."""
    per_rank = []
    for rank in range(world_size):
        s = EpochSampler(num_samples, batch_size=batch_size, rank=rank, world_size=world_size, **kw)
        s.set_epoch(kw.get("seed", 0) + 3)
        order = list(s)
        assert len(order) == len(s)
        per_rank.append(order)
    n_batches = EpochSampler(
        num_samples, batch_size=batch_size, world_size=world_size, **kw
    ).batches_per_epoch
    batches = []
    for b in range(n_batches):
        batch = []
        for order in per_rank:
            batch += order[b * batch_size : (b + 1) * batch_size]
        batches.append(batch)
    return batches


def test_sampler_global_batches_same_at_any_world_size() -> None:
    # Global batch 8: world 1 x 8, world 2 x 4, world 4 x 2.
    ref = _global_batches(50, 8, 1, seed=7)
    assert len(ref) == 6
    for world_size in (2, 4):
        got = _global_batches(50, 8 // world_size, world_size, seed=7)
        assert got == ref  # same samples, same order within the global batch


def test_sampler_partial_batch_split_evenly() -> None:
    # 22 samples, global batch 8 at world 4: the last batch has 6 -> ranks get 2, 2, 1, 1.
    samplers = [
        EpochSampler(22, batch_size=2, world_size=4, rank=r, drop_last=False, seed=1)
        for r in range(4)
    ]
    for s in samplers:
        s.set_epoch(0)
    assert samplers[0].batches_per_epoch == 3
    assert [len(s) for s in samplers] == [6, 6, 5, 5]
    everything = sorted(i for s in samplers for i in s)
    assert everything == list(range(22))
    # And the global batches match world size 1.
    ref = _global_batches(22, 8, 1, seed=1, drop_last=False)
    got = _global_batches(22, 2, 4, seed=1, drop_last=False)
    assert [sorted(b) for b in got] == [sorted(b) for b in ref]


def test_sampler_drop_last() -> None:
    s = EpochSampler(22, batch_size=4, world_size=2)
    assert s.batches_per_epoch == 2 and len(s) == 8
    ranks = [set(EpochSampler(22, batch_size=4, world_size=2, rank=r)) for r in range(2)]
    assert not ranks[0] & ranks[1]


def test_sampler_resume_yields_tail() -> None:
    full = EpochSampler(40, batch_size=4, seed=9)
    full.set_epoch(2)
    order = list(full)
    for k in (0, 1, 5, 10):
        resumed = EpochSampler(40, batch_size=4, seed=9)
        resumed.set_epoch(2, start_batch=k)
        assert list(resumed) == order[k * 4 :]
        assert len(resumed) == 40 - 4 * k
    with pytest.raises(ValueError, match="start_batch"):
        full.set_epoch(2, start_batch=11)


def test_sampler_resume_per_rank() -> None:
    for rank in range(2):
        full = EpochSampler(30, batch_size=3, world_size=2, rank=rank, drop_last=False)
        full.set_epoch(1)
        resumed = EpochSampler(30, batch_size=3, world_size=2, rank=rank, drop_last=False)
        resumed.set_epoch(1, start_batch=2)
        assert list(resumed) == list(full)[2 * 3 :]


def test_sampler_epochs_and_seeds() -> None:
    s = EpochSampler(100, batch_size=10, seed=0)
    s.set_epoch(0)
    e0 = list(s)
    s.set_epoch(1)
    e1 = list(s)
    s.set_epoch(0)
    assert list(s) == e0
    assert e0 != e1 and sorted(e0) == sorted(e1) == list(range(100))
    other = EpochSampler(100, batch_size=10, seed=1)
    assert list(other) != e0  # new samplers start at epoch 0
    # The order is a function of (seed, epoch) alone, not of any global RNG state.
    torch.manual_seed(123)
    again = EpochSampler(100, batch_size=10, seed=0)
    assert list(again) == e0


def test_sampler_no_shuffle_is_identity() -> None:
    s = EpochSampler(10, batch_size=3, shuffle=False, drop_last=False)
    assert list(s) == list(range(10))
    s.set_epoch(4)
    assert list(s) == list(range(10))


# --------------------------------------------------------------------------- loader


@pytest.fixture(scope="module")
def small_synthetic() -> SyntheticShapes:
    return SyntheticShapes(40, image_size=16)


def _epoch(loader: torch.utils.data.DataLoader, epoch: int, start: int = 0) -> list:
    loader.sampler.set_epoch(epoch, start)
    return [(x.clone(), y.clone()) for x, y in loader]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b, strict=True)
    )


def test_loader_uses_epoch_sampler(small_synthetic: SyntheticShapes) -> None:
    loader = build_loader(small_synthetic, batch_size=8, seed=4)
    assert isinstance(loader.sampler, EpochSampler)
    batches = _epoch(loader, 0)
    assert len(batches) == len(loader) == 5
    assert all(x.shape == (8, 3, 16, 16) for x, _ in batches)
    assert not _same(batches, _epoch(loader, 1))
    assert _same(batches, _epoch(loader, 0))
    # Resume from batch 3 gives exactly the last two batches.
    assert _same(_epoch(loader, 0, 3), batches[3:])


def test_loader_workers_match_main_process(small_synthetic: SyntheticShapes) -> None:
    main = build_loader(small_synthetic, batch_size=8, seed=4, num_workers=0)
    workers = build_loader(
        small_synthetic, batch_size=8, seed=4, num_workers=2, persistent_workers=True
    )
    for epoch in (0, 1):
        assert _same(_epoch(main, epoch), _epoch(workers, epoch))
    assert _same(_epoch(main, 1, 2), _epoch(workers, 1, 2))


class _RandomDataset(torch.utils.data.Dataset):
    """Items draw from the worker's torch RNG, to observe how workers are seeded."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> float:
        return float(torch.rand(()))


def test_loader_worker_rng_depends_on_seed_and_epoch() -> None:
    def draws(seed: int, epoch: int) -> list[float]:
        loader = build_loader(_RandomDataset(), batch_size=2, seed=seed, num_workers=2)
        loader.sampler.set_epoch(epoch)
        return torch.cat(list(loader)).tolist()

    reference = draws(0, 0)
    assert len(set(reference)) == len(reference)  # the two workers draw differently
    assert draws(0, 0) == reference
    assert draws(0, 1) != reference
    assert draws(1, 0) != reference


def test_eval_loader_covers_every_sample_once(small_synthetic: SyntheticShapes) -> None:
    loader = build_loader(small_synthetic, batch_size=12, shuffle=False, drop_last=False)
    targets = torch.cat([y for _, y in loader])
    assert torch.equal(targets, small_synthetic.targets)
    assert [len(y) for _, y in loader] == [12, 12, 12, 4]


def test_imagefolder_reads_formats_torchvision_io_lacks_and_names_unreadable_files(
    tmp_path: Path,
) -> None:
    from slipstream.data.datasets import read_rgb

    pixels = np.random.default_rng(0).integers(0, 256, (6, 5, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "a.bmp")
    assert torch.equal(read_rgb(str(tmp_path / "a.bmp")), torch.from_numpy(pixels).permute(2, 0, 1))
    (tmp_path / "broken.jpg").write_bytes(b"not a picture")
    with pytest.raises(DataError, match="cannot decode .*broken.jpg"):
        read_rgb(str(tmp_path / "broken.jpg"))


def test_fit_ends_its_loaders_persistent_workers_and_a_second_fit_starts_new_ones(tmp_path) -> None:
    # Left to the interpreter's exit, they kept an H100 run's process alive 40 s after
    # its summary (Python 3.12: the 5 s join timeout, once per worker).
    import multiprocessing

    from slipstream import Trainer

    data = SyntheticShapes(32, image_size=16, num_classes=4)
    loaders = [
        build_loader(data, batch_size=8, num_workers=2, persistent_workers=True),
        build_loader(data, batch_size=8, shuffle=False, drop_last=False, num_workers=2, persistent_workers=True),
    ]
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 4))
    trainer = Trainer(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), train_data=loaders[0],
        eval_data=loaders[1], max_duration="1ep", run_dir=tmp_path / "run", progress_bar=False, verbose=False,
    )
    trainer.fit()
    assert all(loader._iterator is None for loader in loaders)
    assert multiprocessing.active_children() == []  # no worker left running
    again = Trainer(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), train_data=loaders[0],
        eval_data=loaders[1], max_duration="1ep", run_dir=tmp_path / "again", progress_bar=False, verbose=False,
    ).fit()
    assert again["status"] == "completed" and again["batches"] == 4


def test_issue_44_an_imagefolder_evaluation_leaves_an_unreadable_image_out_instead_of_counting_a_stand_in(
    tmp_path: Path, capsys
) -> None:
    """Issue 44: an unreadable image of the evaluated split was replaced by the next one
    of its class, which the evaluation then counted twice (in the accuracy and the
    samples); the val split leaves it out of its batch, training still replaces it."""
    from helpers import colour_image_folder
    from slipstream.data.datasets import build_datasets

    root = colour_image_folder(tmp_path / "tree", {"a": (200, 0, 0), "b": (0, 200, 0)}, per_class=3)
    (root / "val" / "a" / "1.png").write_bytes(b"not an image")
    (root / "train" / "a" / "1.png").write_bytes(b"not an image")
    train, val, _ = build_datasets("imagefolder", root=root, image_size=8)
    evaluated = build_loader(val, batch_size=4, shuffle=False, drop_last=False)
    labels = [int(y) for _, targets in evaluated for y in targets]
    assert sorted(labels) == [0, 0, 1, 1, 1]  # 6 files, 1 unreadable: 5 evaluated, none twice
    err = capsys.readouterr().err
    assert "1.png (" in err and "it is left out of the evaluation" in err
    trained = build_loader(train, batch_size=3, shuffle=False, drop_last=False)
    assert sum(len(targets) for _, targets in trained) == 6  # training: a stand-in, batch counts kept
    assert "the next image in the image's class is used in its place" in capsys.readouterr().err
