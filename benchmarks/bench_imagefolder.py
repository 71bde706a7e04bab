"""ImageFolder loading: images/s of Slipstream's imagefolder dataset against torchvision's
`datasets.ImageFolder` + `DataLoader`, same workers, batch size and output size, in one
process, interleaved (A B A B ...), for a PNG tree and a JPEG tree written with Pillow.

Ours decodes to uint8 and resizes the uint8 tensor; torchvision's usual pipeline
decodes with PIL, resizes the PIL image and converts to float (`ToTensor`). A second
table times the decoders alone (PIL vs torchvision.io), which is how the dataset's
decoder was chosen.

    .venv/bin/python benchmarks/bench_imagefolder.py            # ~2 min idle
    .venv/bin/python benchmarks/bench_imagefolder.py --workers 2
    .venv/bin/python benchmarks/bench_imagefolder.py --quick
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

from common import image_folder_args
from slipstream.data import build_datasets, build_loader
from slipstream.data.datasets import read_rgb


def write_tree(root: Path, fmt: str, classes: int, per_class: int, size: tuple[int, int]) -> None:
    """train/ and val/ folders of smooth random pictures (noise compresses unlike photos)."""
    rng = np.random.default_rng(0)
    w, h = size
    for split in ("train", "val"):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(per_class if split == "train" else 1):
                coarse = rng.integers(0, 256, (h // 8, w // 8, 3), dtype=np.uint8)
                image = Image.fromarray(coarse).resize((w, h), Image.BICUBIC)
                kwargs = {"quality": 90} if fmt == "jpeg" else {}
                image.save(folder / f"{i}.{'jpg' if fmt == 'jpeg' else 'png'}", **kwargs)


def images_per_s(loader: Iterable, n: int) -> float:
    start = time.perf_counter()
    for _ in loader:
        pass
    return n / (time.perf_counter() - start)


def ours(root: Path, size: int, batch: int, workers: int) -> tuple[DataLoader, int]:
    train, _, _ = build_datasets("imagefolder", root=root, image_size=size)
    return build_loader(train, batch_size=batch, num_workers=workers, drop_last=False), len(train)


def torchvision_baseline(root: Path, size: int, batch: int, workers: int) -> tuple[DataLoader, int]:
    tf = transforms.Compose([transforms.Resize(size), transforms.CenterCrop(size), transforms.ToTensor()])
    train = datasets.ImageFolder(str(root / "train"), transform=tf)
    return DataLoader(train, batch_size=batch, shuffle=True, num_workers=workers), len(train)


def pil_rgb(path: str) -> torch.Tensor:
    with Image.open(path) as image:
        return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)


def decode_rate(decode: Callable[[str], torch.Tensor], files: list[str]) -> float:
    start = time.perf_counter()
    for f in files:
        decode(f)
    return len(files) / (time.perf_counter() - start)


def main() -> None:
    args = image_folder_args(__doc__.splitlines()[0])
    print(
        f"{args.per_class * 10} images of {args.source[0]}x{args.source[1]} -> {args.size} px, "
        f"batch {args.batch}, {args.workers} workers, {args.threads} threads"
    )
    print(f"{'format':<6} {'ours img/s':>11} {'torchvision img/s':>18} {'ratio':>7}"
          f" {'PIL decode/s':>13} {'tv.io decode/s':>15}")  # fmt: skip
    for fmt in ("png", "jpeg"):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            write_tree(root, fmt, 10, args.per_class, tuple(args.source))
            rates: dict[str, list[float]] = {"ours": [], "torchvision": [], "pil": [], "tvio": []}
            files = sorted(str(f) for f in (root / "train").rglob("*.*"))[:200]
            for _ in range(args.repeats):  # interleaved: a busy machine slows both alike
                for name, build in (("ours", ours), ("torchvision", torchvision_baseline)):
                    loader, n = build(root, args.size, args.batch, args.workers)
                    rates[name].append(images_per_s(loader, n))
                rates["pil"].append(decode_rate(pil_rgb, files))
                rates["tvio"].append(decode_rate(read_rgb, files))
            med = {k: statistics.median(v) for k, v in rates.items()}
            print(
                f"{fmt:<6} {med['ours']:>11.0f} {med['torchvision']:>18.0f} "
                f"{med['ours'] / med['torchvision']:>6.2f}x {med['pil']:>13.0f} {med['tvio']:>15.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
