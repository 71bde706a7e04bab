"""The ImageNet input pipeline on a GPU (issue 41's measurement), whole training steps
through ``slipstream.Trainer``, one process, one run per variant:

- ``data, decode=cpu``: ResNet-50 in bf16 and channels-last, trained on 176 px random
  resized crops (0.08-1, 3/4-4/3, flip) of photo-sized JPEGs read from WebDataset
  shards with their index (``slipstream data convert``), every core a loader worker
  decoding with Pillow (reduced-size decoding on, the default);
- ``data, decode=gpu``: the same, the workers reading the bytes and drawing the crops,
  nvJPEG decoding each batch on the device (``data.decode=gpu``);
- ``on-device``: the same model, precision, memory format and optimizer on one batch
  already on the device: what the steps cost without any data.

Each rate is images/s between the end of step ``--warmup`` and the end of the last
step, the device synchronised at both (the loader's start and cuDNN's first choices
left out; an epoch's end, where a stream starts its workers again, left in, as a run
has it). MFU: the run's own (FLOPs counted once, against the probed bf16 peak), scaled
to that window. The pictures: ``bench_data_timm.photo`` (smooth shapes at three scales
and a little noise), ``--source`` W H (500x375), quality 90, written by every core.
The last line reads ``pipeline data/on-device images/s: R (data A, on-device B, decode
gpu/cpu D)``; the goals are R >= 0.9 and A >= 3,000 on an H100 or H200.

    python benchmarks/bench_pipeline.py --images 20000 --workers $(nproc)   # on the GPU machine
    .venv/bin/python benchmarks/bench_pipeline.py --dry-run                  # toy, on the CPU (or --quick)
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from bench_decode import write_photos
from common import parser
from slipstream import Algorithm, Trainer, hookimpl


class Window(Algorithm):
    """The wall time between the end of step ``warmup`` and the end of step ``steps``,
    the device synchronised at both."""

    name = "bench_window"

    def __init__(self, warmup: int, steps: int) -> None:
        super().__init__()
        self.warmup, self.steps, self.done, self.marks = warmup, steps, 0, {}

    @hookimpl
    def batch_end(self, state) -> None:
        self.done += 1
        if self.done in (self.warmup, self.steps):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.marks[self.done] = time.perf_counter()

    def seconds(self) -> float:
        return self.marks[self.steps] - self.marks[self.warmup]


class DeviceBatch:
    """One batch already on the device, as the loader yields it (uint8 images, int64
    labels), ``steps`` times."""

    def __init__(self, batch: int, size: int, steps: int, device: torch.device) -> None:
        self.steps = steps
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=generator).to(device)
        self.labels = torch.randint(0, 10, (batch,), generator=generator).to(device)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        return iter([(self.images, self.labels)] * self.steps)


def shards(root: Path, images: int, source: tuple[int, int], processes: int) -> str:
    """``images`` photos as an ImageFolder tree, then as WebDataset shards with their
    index; the shards' ``data.urls``."""
    from slipstream_webdataset import convert_imagefolder

    write_photos(root / "tree", images, source, processes)
    written = convert_imagefolder(str(root / "tree"), str(root / "shards"), shard_size=64 << 20, progress=False)
    return written["urls"]


def shard_loader(urls: str, size: int, batch: int, workers: int, decode: str):
    """The webdataset plugin's training loader as a run builds it (its index beside the
    shards); ``decode=gpu`` without CUDA decodes its batches on the CPU (the dry run)."""
    from slipstream.config.schema import build_config
    from slipstream.data import DataRequest, build_dataset_plugin
    from slipstream.data.geometry import geometries
    from slipstream.data.gpu_decode import DecodeSwitch

    cfg = build_config(None, None, ["data.name=webdataset", f"data.urls={urls}", f"data.image_size={size}"])
    plugin = build_dataset_plugin(dict(cfg.data))
    train, evaluation = geometries(cfg.data, type(plugin).photos, seed=0)
    if decode == "gpu":  # set here, not by data.decode: that refuses a machine without CUDA
        train = replace(train, switch=DecodeSwitch("gpu", True))
    request = DataRequest(
        image_size=size, batch_size=batch, eval_batch_size=batch, num_workers=workers,
        pin_memory=torch.cuda.is_available(), train_geometry=train, eval_geometry=evaluation,
    )  # fmt: skip
    return plugin.build(request).train


def run(data, model_name: str, batch: int, steps: int, warmup: int, device: torch.device, run_dir: Path) -> dict:
    """``steps`` training steps of the model on ``data``; images/s and MFU of the window."""
    from slipstream.models import build_model
    from slipstream.optim import build_optimizer
    from slipstream.plugins.discovery import discover, plugin_config

    torch.manual_seed(0)
    model = build_model(model_name, num_classes=10)
    found = discover()
    algorithms = [
        found["mixed_precision"].cls(plugin_config(found["mixed_precision"].cls, {"dtype": "bf16"})),
        found["channels_last"].cls(plugin_config(found["channels_last"].cls, {"mode": "always"})),
    ]
    window = Window(warmup, steps)
    trainer = Trainer(
        model=model, optimizer=build_optimizer(model, "sgd", 0.1), train_data=data, eval_interval=None,
        max_duration=f"{steps}ba", algorithms=[*algorithms, window], run_dir=run_dir, checkpoint_interval=None,
        device=device, autotune=False, progress_bar=False, verbose=False,
    )  # fmt: skip
    trainer.fit()
    summary = trainer.summary
    rate = (steps - warmup) * batch / window.seconds()
    whole = summary.get("samples_per_s") or 0.0
    mfu = summary.get("mfu")
    return {"images_s": rate, "mfu": None if mfu is None or not whole else mfu * rate / whole}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=20000)
    p.add_argument("--source", type=int, nargs=2, default=[500, 375], help="written W H")
    p.add_argument("--size", type=int, default=176, help="training crop side (px)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU (the 'gpu' side decodes there)")
    p.set_defaults(steps=150, warmup=30)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*TorchVision are deprecated.*")
    warnings.filterwarnings("ignore", message="mixed_precision: dtype bf16 on a CPU")  # the dry run's, said
    if args.dry_run or args.quick:  # run_all.py --quick: the same toy run
        args.images, args.source, args.size, args.batch = 32, [48, 36], 16, 8
        args.workers, args.model, args.steps, args.warmup = 1, "test_resnet", 6, 2
        device = torch.device("cpu")
    elif not torch.cuda.is_available():  # run_all.py on a CPU machine: said, not failed
        print("bench_pipeline: skipped: it measures a GPU and there is none (--dry-run: toy sizes on the CPU)")
        return
    else:
        device = torch.device("cuda")
    with tempfile.TemporaryDirectory(prefix="bench_pipeline-") as scratch:
        root = Path(scratch)
        started = time.perf_counter()
        urls = shards(root, args.images, tuple(args.source), args.workers)
        print(
            f"{args.images} JPEGs {args.source[0]}x{args.source[1]} written as shards in "
            f"{time.perf_counter() - started:.1f} s; {args.model}, bf16 + channels-last, {args.size} px crops, "
            f"batch {args.batch}, {args.workers} workers, steps {args.warmup}-{args.steps} timed",
            flush=True,
        )
        results = {}
        variants = {
            "on-device": lambda: DeviceBatch(args.batch, args.size, args.steps, device),
            "data, decode=cpu": lambda: shard_loader(urls, args.size, args.batch, args.workers, "cpu"),
            "data, decode=gpu": lambda: shard_loader(urls, args.size, args.batch, args.workers, "gpu"),
        }
        for name, data in variants.items():
            run_dir = root / name.replace(" ", "").replace(",", "_")
            results[name] = run(data(), args.model, args.batch, args.steps, args.warmup, device, run_dir)
            mfu = results[name]["mfu"]
            print(f"  {name:18s} {results[name]['images_s']:9.1f} images/s"
                  + ("" if mfu is None else f"  MFU {100 * mfu:.1f} %"), flush=True)  # fmt: skip
    on_device = results["on-device"]["images_s"]
    best = max(("data, decode=cpu", "data, decode=gpu"), key=lambda n: results[n]["images_s"])
    data = results[best]["images_s"]
    decode = results["data, decode=gpu"]["images_s"] / results["data, decode=cpu"]["images_s"]
    print(f"pipeline data/on-device images/s: {data / on_device:.2f} (data A={data:.0f} with {best.split(', ')[1]}, "
          f"on-device B={on_device:.0f}, decode gpu/cpu D={decode:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
