"""Training crops from JPEG shards: images/s through Slipstream's webdataset loader and
through timm's own loader, same shards, transforms, workers and batch size, in one
process, interleaved. `bench_data.py --against timm` runs this script.

The images: photo-like JPEGs (smooth shapes at three scales plus a little sensor-like
noise; pure random noise decodes far slower than photos), 500x375 by default, quality
90, written as an ImageFolder tree and converted to WebDataset shards by `slipstream
data convert`'s writer (at least 4 shards per worker, so that timm, which splits the
shards among its workers, keeps every worker busy).

Both sides make 224 px training crops: RandomResizedCrop (scale 0.08-1, ratio
0.75-1.3333, bilinear) from the whole decoded image, a horizontal flip with p 0.5, no
colour jitter, auto-augment or random erasing, and deliver uint8 ``B x 3 x 224 x 224``
batches; float conversion and normalisation happen later on the device on both sides
and are not timed.

- timm: ``timm.data.create_dataset("wds/...")`` (timm's WebDataset reader, reading the
  same shards through an ``_info.json`` beside them, as timm's ImageNet shards have
  one) and ``timm.data.create_loader(..., is_training=True, use_prefetcher=True,
  color_jitter=None, auto_augment=None, re_prob=0)``: full PIL decode,
  RandomResizedCropAndInterpolation, RandomHorizontalFlip, MaybePILToTensor (uint8),
  ``fast_collate`` (uint8). Its batches are read from the DataLoader inside the
  returned PrefetchLoader (``loader.loader``): the prefetcher only copies to the GPU and
  normalises there. timm's defaults otherwise (persistent workers, its shuffle buffer).
- Slipstream: the ``webdataset`` dataset plugin as a run builds it (``build_config`` ->
  ``geometries`` -> ``plugin.build``), ``data.train_crop=random_resized`` and the
  defaults above; once with ``data.reduced_decoding=false`` (full decode, then one box
  resize) and once with ``true`` (a JPEG whose crop box is at least twice the output
  side decoded at 1/2, 1/4 or 1/8 scale, Pillow's ``draft``). Its loader starts its
  workers each epoch, as in a run.

Each loader is warmed up with one untimed epoch, then each round times one epoch of
each, the order reversed every other round; the medians are reported. The main process
runs ``torch.set_num_threads(--threads)``; DataLoader workers run one thread each
(PyTorch's default in workers), on both sides.

The last line reads ``slipstream/timm images/s: R (slipstream A, timm B)`` for reduced
decoding, the line before it the same for full decoding.

    .venv/bin/python benchmarks/bench_data.py --against timm          # a few minutes idle
    .venv/bin/python benchmarks/bench_data_timm.py --workers 4 --images 4000
    .venv/bin/python benchmarks/bench_data_timm.py --quick            # under two minutes on 2 cores
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import tarfile
import tempfile
import time
import warnings
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from common import parser

SCALE, RATIO = (0.08, 1.0), (0.75, 1.3333)


def photo(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """A photo-like picture: smooth random shapes at three scales, plus noise."""
    out = np.zeros((height, width, 3), np.float32)
    for div, amp in ((48, 1.0), (12, 0.45), (3, 0.18)):
        coarse = rng.integers(0, 256, (max(2, height // div), max(2, width // div), 3), dtype=np.uint8)
        out += amp * np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC), np.float32)
    out = (out - out.mean()) * (50 / out.std()) + 120
    out += rng.standard_normal(out.shape, dtype=np.float32) * 4
    return Image.fromarray(np.clip(out, 0, 255).astype(np.uint8))


def write_photos(root: Path, images: int, size: tuple[int, int], classes: int = 10) -> int:
    """root/train/<class>/*.jpg (``images`` in all) and one val image per class; the
    train images' total bytes."""
    rng = np.random.default_rng(0)
    total = 0
    for split, count in (("train", images), ("val", classes)):
        for i in range(count):
            folder = root / split / f"class{i % classes}"
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{i}.jpg"
            photo(rng, *size).save(path, quality=90)
            total += path.stat().st_size if split == "train" else 0
    return total


def write_timm_info(shard_dir: Path, name: str = "bench") -> None:
    """timm's ``_info.json`` for the train shards: each shard's file name and sample count."""
    files = sorted(shard_dir.glob("train-*.tar"))
    lengths = []
    for f in files:
        with tarfile.open(f) as tar:
            lengths.append(sum(1 for m in tar.getmembers() if m.name.endswith(".cls")))
    split = {"name": "train", "num_samples": sum(lengths), "filenames": [f.name for f in files],
             "shard_lengths": lengths}  # fmt: skip
    (shard_dir / "_info.json").write_text(json.dumps({"name": name, "splits": {"train": split}}))


def slipstream_loader(urls: str, reduced: bool, size: int, batch: int, workers: int) -> Iterable:
    from slipstream.config.schema import build_config
    from slipstream.data import DataRequest, build_dataset_plugin
    from slipstream.data.geometry import geometries

    cfg = build_config(None, None, [
        "data.name=webdataset", f"data.urls={urls}", f"data.image_size={size}",
        "data.train_crop=random_resized", f"data.scale=[{SCALE[0]},{SCALE[1]}]",
        f"data.ratio=[{RATIO[0]},{RATIO[1]}]", "data.interpolation=bilinear", "data.hflip=0.5",
        f"data.reduced_decoding={str(reduced).lower()}",
    ])  # fmt: skip
    plugin = build_dataset_plugin(dict(cfg.data))
    train_g, eval_g = geometries(cfg.data, type(plugin).photos, seed=0)
    request = DataRequest(image_size=size, batch_size=batch, eval_batch_size=batch, num_workers=workers,
                          train_geometry=train_g, eval_geometry=eval_g)  # fmt: skip
    return plugin.build(request).train


def timm_loader(shard_dir: Path, size: int, batch: int, workers: int) -> tuple[Iterable, object]:
    """timm's uint8 DataLoader (inside its PrefetchLoader) and its dataset (set_epoch)."""
    from timm.data import create_dataset, create_loader

    dataset = create_dataset("wds/bench", root=str(shard_dir), split="train", is_training=True, batch_size=batch)
    loader = create_loader(
        dataset, input_size=(3, size, size), batch_size=batch, is_training=True, no_aug=False,
        scale=SCALE, ratio=RATIO, hflip=0.5, vflip=0.0, color_jitter=None, auto_augment=None, re_prob=0.0,
        interpolation="bilinear", num_workers=workers, use_prefetcher=True, device=torch.device("cpu"),
    )  # fmt: skip
    return loader.loader, dataset


def epoch_rate(loader: Iterable, set_epoch, epoch: int, size: int) -> float:
    """Images/s of one epoch; checks the batches are uint8 ``B x 3 x size x size``."""
    set_epoch(epoch)
    start, n = time.perf_counter(), 0
    for images, _ in loader:
        if images.dtype != torch.uint8 or tuple(images.shape[1:]) != (3, size, size):
            raise SystemExit(f"unexpected batch {images.dtype} {tuple(images.shape)}")
        n += len(images)
    return n / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers, both sides (default 2)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--size", type=int, default=224, help="training crop side (px)")
    p.add_argument("--source", type=int, nargs=2, default=[500, 375], help="written W H")
    p.add_argument("--images", type=int, default=1536, help="training images written (--quick: 384)")
    p.set_defaults(repeats=5)
    args = p.parse_args(argv)
    if args.quick:
        args.images, args.repeats = 384, 3
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*TorchVision are deprecated.*")
    logging.getLogger("timm").setLevel(logging.ERROR)
    from slipstream_webdataset import convert_imagefolder

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        total = write_photos(root / "tree", args.images, tuple(args.source))
        shards = max(8, 4 * args.workers)
        shard_dir = root / "wds"
        urls = convert_imagefolder(str(root / "tree"), str(shard_dir), shard_size=math.ceil(total / shards) + 1,
                                   progress=False)["urls"]  # fmt: skip
        write_timm_info(shard_dir)
        written = len(list(shard_dir.glob("train-*.tar")))
        print(
            f"{args.images} JPEGs {args.source[0]}x{args.source[1]} q90 (mean {total / args.images / 1000:.0f} KB) "
            f"in {written} shards -> {args.size} px RandomResizedCrop + hflip, uint8 batches of {args.batch}, "
            f"{args.workers} workers, {args.threads} threads, {args.repeats} rounds (median)",
            flush=True,
        )
        timm_iter, timm_ds = timm_loader(shard_dir, args.size, args.batch, args.workers)
        sides: dict[str, tuple[Iterable, object]] = {"timm": (timm_iter, timm_ds.set_epoch)}
        for reduced in (False, True):
            loader = slipstream_loader(urls, reduced, args.size, args.batch, args.workers)
            sides[f"slipstream reduced_decoding={str(reduced).lower()}"] = (loader, loader.sampler.set_epoch)
        for loader, set_epoch in sides.values():  # warm-up: worker start, page cache, imports
            epoch_rate(loader, set_epoch, 0, args.size)
        rates: dict[str, list[float]] = {name: [] for name in sides}
        order = list(sides)
        for r in range(args.repeats):  # interleaved: a busy machine slows every side alike
            for name in order if r % 2 == 0 else order[::-1]:
                rates[name].append(epoch_rate(*sides[name], r + 1, args.size))
    med = {name: statistics.median(v) for name, v in rates.items()}
    print(f"{'loader':<36} {'images/s':>9}  spread (min-max)")
    for name, v in rates.items():
        print(f"{name:<36} {med[name]:>9.0f}  {min(v):.0f}-{max(v):.0f}")
    b = med["timm"]
    full, reduced = med["slipstream reduced_decoding=false"], med["slipstream reduced_decoding=true"]
    print(f"full decoding (data.reduced_decoding=false): slipstream/timm images/s: {full / b:.2f} "
          f"(slipstream {full:.0f}, timm {b:.0f})")  # fmt: skip
    print(f"slipstream/timm images/s: {reduced / b:.2f} (slipstream {reduced:.0f}, timm {b:.0f})", flush=True)


if __name__ == "__main__":
    main()
