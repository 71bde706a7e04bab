"""Data sources: images/s through Slipstream's loaders and through each library's own
plain loader, same images, workers, batch size and output size, in one process,
interleaved (A B A B ...).

The same JPEG pictures are written as an ImageFolder tree, as WebDataset shards (with
`slipstream data convert`'s writer) and as a Hugging Face dataset on disk. Slipstream's
side is the dataset plugin (`imagefolder`, `webdataset`, `huggingface`) as a run builds
it: uint8 decode with torchvision.io, uint8 resize, batches stay uint8 (float and
normalisation happen on the device, not timed here). Each library's side is its usual
pipeline: torchvision `ImageFolder`; `webdataset.WebDataset(...).decode("pil")`; a
`datasets` Dataset with `set_transform`; each with PIL decode, PIL resize and
`ToTensor`, in a `DataLoader` with the same workers.

    .venv/bin/python benchmarks/bench_data.py            # a few minutes idle
    .venv/bin/python benchmarks/bench_data.py --workers 2
    .venv/bin/python benchmarks/bench_data.py --quick
    .venv/bin/python benchmarks/bench_data.py --against timm [--quick]   # bench_data_timm.py:
        224 px training crops from JPEG shards, Slipstream's loader against timm's
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from torchvision import datasets as tv_datasets
from torchvision import transforms

from bench_imagefolder import write_tree
from common import image_folder_args
from slipstream.data import DataRequest, build_dataset_plugin


def images_per_s(loader: Iterable) -> float:
    start, n = time.perf_counter(), 0
    for images, _ in loader:
        n += len(images)
    return n / (time.perf_counter() - start)


def pil_pipeline(size: int) -> transforms.Compose:
    return transforms.Compose([transforms.Resize(size), transforms.CenterCrop(size), transforms.ToTensor()])


def write_formats(root: Path) -> dict[str, dict]:
    """The tree under root/tree as shards (root/wds) and a Hugging Face dataset (root/hf)."""
    import datasets
    from slipstream_webdataset import convert_imagefolder

    tree = root / "tree"
    result = convert_imagefolder(str(tree), str(root / "wds"), shard_size=8 * 10**6, progress=False)
    train = tv_datasets.ImageFolder(str(tree / "train"))
    val = tv_datasets.ImageFolder(str(tree / "val"))
    features = datasets.Features(image=datasets.Image(), label=datasets.ClassLabel(names=train.classes))

    def table(folder: tv_datasets.ImageFolder) -> datasets.Dataset:
        return datasets.Dataset.from_dict(
            {"image": [{"bytes": Path(p).read_bytes(), "path": None} for p, _ in folder.samples],
             "label": [y for _, y in folder.samples]},
            features=features,
        )  # fmt: skip

    datasets.disable_progress_bars()
    datasets.DatasetDict({"train": table(train), "validation": table(val)}).save_to_disk(str(root / "hf"))
    return {
        "imagefolder": {"name": "imagefolder", "root": str(tree)},
        "webdataset": {"name": "webdataset", "urls": result["urls"], "eval_urls": result["eval_urls"]},
        "huggingface": {"name": "huggingface", "path": str(root / "hf")},
    }


def ours(options: dict, size: int, batch: int, workers: int) -> Iterable:
    request = DataRequest(image_size=size, batch_size=batch, eval_batch_size=batch, num_workers=workers,
                          drop_last=False)  # fmt: skip
    loader = build_dataset_plugin(options).build(request).train
    loader.sampler.set_epoch(0)
    return loader


def theirs(kind: str, options: dict, size: int, batch: int, workers: int) -> Iterable:
    tf = pil_pipeline(size)
    if kind == "imagefolder":
        ds = tv_datasets.ImageFolder(str(Path(options["root"]) / "train"), transform=tf)
        return DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers)
    if kind == "webdataset":
        import webdataset as wds

        ds = wds.WebDataset(options["urls"], shardshuffle=False, empty_check=False)
        ds = ds.decode("pil").to_tuple("jpg", "cls").map_tuple(tf, int)
        return DataLoader(ds.batched(batch), batch_size=None, num_workers=workers)
    import datasets

    ds = datasets.load_from_disk(options["path"])["train"]
    ds.set_transform(lambda b: {"image": [tf(im.convert("RGB")) for im in b["image"]], "label": b["label"]})
    collate = lambda rows: (torch.stack([r["image"] for r in rows]), torch.tensor([r["label"] for r in rows]))  # noqa: E731
    return DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers, collate_fn=collate)


def main() -> None:
    against = argparse.ArgumentParser(add_help=False)
    against.add_argument("--against", choices=["timm"])
    chosen, rest = against.parse_known_args()
    if chosen.against == "timm":
        from bench_data_timm import main as against_timm

        against_timm(rest)
        return
    args = image_folder_args(__doc__.splitlines()[0])
    print(
        f"{args.per_class * 10} JPEG images of {args.source[0]}x{args.source[1]} -> {args.size} px, "
        f"batch {args.batch}, {args.workers} workers, {args.threads} threads, {args.repeats} repeats (median)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_tree(root / "tree", "jpeg", 10, args.per_class, tuple(args.source))
        sources = write_formats(root)
        rates: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.repeats):  # interleaved: a busy machine slows both alike
            for kind, options in sources.items():
                for side in ("slipstream", "library"):
                    loader = (ours(options, args.size, args.batch, args.workers) if side == "slipstream"
                              else theirs(kind, options, args.size, args.batch, args.workers))  # fmt: skip
                    rates.setdefault((kind, side), []).append(images_per_s(loader))
    print(f"{'source':<12} {'slipstream img/s':>17} {'library img/s':>14} {'ratio':>7}  spread (min-max, both)")
    for kind in sources:
        a, b = rates[(kind, "slipstream")], rates[(kind, "library")]
        print(
            f"{kind:<12} {statistics.median(a):>17.0f} {statistics.median(b):>14.0f} "
            f"{statistics.median(a) / statistics.median(b):>6.2f}x  "
            f"{min(a):.0f}-{max(a):.0f} / {min(b):.0f}-{max(b):.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
