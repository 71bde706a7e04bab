"""JPEG training crops through the imagefolder loader, two questions, each side by side
in one process, interleaved (A B A B ...), medians reported:

``--what decode``: ``data.decode=gpu`` against ``cpu``: nvJPEG decoding each batch on
the device (the workers read the bytes and draw the crops) against the workers' full
PIL decode. Images/s of whole epochs, the GPU side synchronised at the end. The last
line reads ``data.decode gpu/cpu images/s: R (gpu A, cpu B)``.

``--what told``: an image-size curriculum's small epochs: the loader told the small
size (``slipstream.data.loaders.set_output_size``: the workers cut small crops, and
reduced-size decoding applies to more of them) against the loader's full-size crops
shrunk by the curriculum's ``resize_batch`` in the main process (what the plugin does
without it, on the CPU here). The last line reads ``told/resized images/s: R (told A,
resized B)``.

The pictures: ``bench_data_timm.photo`` (photo-like: smooth shapes at three scales and
a little noise), ``--source`` W H (500x375), quality 90, written by ``--workers``
processes. Training crops as a photo run makes them: RandomResizedCrop (0.08-1,
3/4-4/3), bilinear, flip 0.5, reduced-size decoding on (the default).

    .venv/bin/python benchmarks/bench_decode.py --what told --workers 2 --images 512
    python benchmarks/bench_decode.py --what decode --images 4096 --workers 16 --size 176 --batch 256
    .venv/bin/python benchmarks/bench_decode.py --what decode --dry-run   # toy, the "gpu" side on the CPU
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from bench_data_timm import photo
from common import parser


def _write(args: tuple[Path, int, int, tuple[int, int]]) -> None:
    root, first, count, size = args
    rng = np.random.default_rng(first)
    for i in range(first, first + count):
        folder = root / f"class{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        photo(rng, *size).save(folder / f"{i}.jpg", quality=90)


def write_photos(root: Path, images: int, size: tuple[int, int], processes: int) -> None:
    """root/train (``images`` JPEGs in 10 classes) and root/val (10), written in parallel."""
    processes = max(1, processes)
    per = -(-images // processes)
    jobs = [(root / "train", p * per, min(per, images - p * per), size) for p in range(processes) if p * per < images]
    jobs.append((root / "val", 10**9, 10, size))
    if processes == 1:  # no pool: a process's start costs more than a toy set of pictures
        list(map(_write, jobs))
        return
    with ProcessPoolExecutor(processes) as pool:
        list(pool.map(_write, jobs))


def loader(root: Path, size: int, batch: int, workers: int, decode: str = "cpu"):
    """The imagefolder plugin's training loader as a run builds it; ``decode=gpu`` on a
    machine without CUDA decodes its batches on the CPU (the dry run)."""
    from slipstream.config.schema import build_config
    from slipstream.data import DataRequest, build_dataset_plugin
    from slipstream.data.geometry import geometries
    from slipstream.data.gpu_decode import DecodeSwitch

    cfg = build_config(None, None, ["data.name=imagefolder", f"data.root={root}", f"data.image_size={size}"])
    plugin = build_dataset_plugin(dict(cfg.data))
    train, evaluation = geometries(cfg.data, type(plugin).photos, seed=0)
    if decode == "gpu":  # set here, not by data.decode: that refuses a machine without CUDA
        train = replace(train, switch=DecodeSwitch("gpu", True))
    request = DataRequest(image_size=size, batch_size=batch, eval_batch_size=batch, num_workers=workers,
                          drop_last=False, train_geometry=train, eval_geometry=evaluation)  # fmt: skip
    return plugin.build(request).train


def epoch_rate(data, epoch: int, after=None) -> float:
    """Images/s of one epoch of ``data`` (each batch through ``after``, if given)."""
    data.sampler.set_epoch(epoch)
    started, n = time.perf_counter(), 0
    for images, _ in data:
        if after is not None:
            images = after(images)
        n += len(images)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return n / (time.perf_counter() - started)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--what", choices=["decode", "told"], default="told")
    p.add_argument("--images", type=int, default=512)
    p.add_argument("--source", type=int, nargs=2, default=[500, 375], help="written W H")
    p.add_argument("--size", type=int, default=224, help="full output side (px)")
    p.add_argument("--small", type=int, default=112, help="--what told: the curriculum's small side (px)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU, one round")
    args = p.parse_args()
    if args.dry_run or args.quick:
        args.images, args.source, args.size, args.small, args.batch, args.repeats = 32, [64, 48], 32, 16, 8, 1
        args.workers = 0  # in-process: the dry run checks the path, not the rates
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*TorchVision are deprecated.*")
    if args.what == "decode" and not torch.cuda.is_available() and not args.dry_run:
        print("bench_decode: --what decode needs CUDA (or --dry-run: the 'gpu' side on the CPU)", file=sys.stderr)
        raise SystemExit(2)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (no CUDA)"
    print(f"{args.images} JPEGs of {args.source[0]}x{args.source[1]} q90 -> {args.size} px random resized crops, "
          f"batch {args.batch}, {args.workers} workers, {args.threads} threads, device {device}, "
          f"{args.repeats} rounds (median)", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        write_photos(root, args.images, tuple(args.source), args.workers)
        print(f"wrote the pictures in {time.perf_counter() - started:.1f} s", flush=True)
        if args.what == "decode":
            sides = {"gpu": loader(root, args.size, args.batch, args.workers, "gpu"),
                     "cpu": loader(root, args.size, args.batch, args.workers)}  # fmt: skip
            after = dict.fromkeys(sides)
        else:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "algorithms" / "image_size_curriculum"))
            from slipstream_image_size_curriculum import resize_batch

            from slipstream.data.loaders import set_output_size

            told = loader(root, args.size, args.batch, args.workers)
            assert set_output_size(told, args.small)
            sides = {"told": told, "resized": loader(root, args.size, args.batch, args.workers)}
            after = {"told": None, "resized": lambda images: resize_batch(images, args.small)}
        for name, data in sides.items():  # warm: page cache, CUDA and nvJPEG (the dry run is cold)
            if not args.dry_run:
                epoch_rate(data, 0, after[name])
        rates: dict[str, list[float]] = {name: [] for name in sides}
        for r in range(args.repeats):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for name in order:
                rates[name].append(epoch_rate(sides[name], r + 1, after[name]))
    for name, values in rates.items():
        print(f"{name:<8} {statistics.median(values):9.0f} images/s  (rounds {', '.join(f'{v:.0f}' for v in values)})")
    a, b = (statistics.median(v) for v in rates.values())
    first, second = rates
    label = "data.decode gpu/cpu" if args.what == "decode" else "told/resized"
    print(f"{label} images/s: {a / b:.2f} ({first} {a:.0f}, {second} {b:.0f})")


if __name__ == "__main__":
    main()
