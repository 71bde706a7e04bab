"""``data.decode: gpu``: JPEGs decoded on the GPU in batches (nvJPEG, through
``torchvision.io.decode_jpeg(list, device="cuda")``), cut there as the CPU path cuts them.

The loader's workers still open each file, but read only its header: the crop's box
and the flip are drawn there, from the sample's own generator
(:meth:`Geometry.load <slipstream.data.geometry.Geometry.load>`), exactly as the CPU
path draws them, and the item is the file's bytes with that crop (:class:`Encoded`).
The main process decodes the batch's JPEGs in one call, turns each upright (EXIF),
cuts its box, resizes it (antialiased, as Pillow does) and flips it on the device:
the same ``uint8 N x 3 x S x S`` batch the CPU path gives, already on the GPU. What
nvJPEG is not given (PNG and other formats, greyscale and CMYK JPEGs) is decoded on
the CPU in the worker as before, and said once.

``data.decode: auto`` measures both on the run's first samples before training and
keeps the faster (:func:`choose_decode`); without CUDA it is ``cpu`` and says why.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader

from slipstream.errors import ConfigError

DECODES = ("cpu", "gpu", "auto")
# The GPU decode changes the pixels slightly (another decoder, no reduced-size decoding)
# and takes main-thread and GPU time from the step: taken by auto only where it is more
# than this much faster.
GPU_MARGIN = 0.1
_said: set[str] = set()  # what this process has said once


class DecodeSwitch:
    """Whether the workers hand over JPEG bytes (``on``) for the GPU to decode; ``mode``
    is the config's ``gpu`` or ``auto`` (which :func:`choose_decode` sets)."""

    def __init__(self, mode: str, on: bool) -> None:
        self.mode = mode
        self.on = on


def decode_switch(value: Any) -> DecodeSwitch | None:
    """The switch of ``data.decode`` (None for ``cpu``): a ConfigError for a value that is
    none of cpu, gpu, auto, or for ``gpu`` on a machine without CUDA."""
    value = "cpu" if value is None else value
    if value not in DECODES:
        raise ConfigError(f"data.decode must be one of {', '.join(DECODES)}, got {value!r}")
    if value == "cpu" or not torch.cuda.is_available():
        if value == "gpu":
            raise ConfigError(
                "data.decode=gpu needs a CUDA device, and torch.cuda.is_available() is False on this "
                "machine; use data.decode=cpu (or auto, which is cpu without CUDA)"
            )
        return None  # auto without CUDA: the CPU, which choose_decode reports
    return DecodeSwitch(value, on=value == "gpu")


class Encoded(NamedTuple):
    """A JPEG's bytes and the cut the worker drew for it: ``box`` (left, top, right,
    bottom) in the upright image, the output ``size``, the ``flip``, the EXIF
    ``orientation`` (1: upright) and the ``interpolation``."""

    data: torch.Tensor
    box: tuple[float, float, float, float]
    size: int
    flip: bool
    orientation: int = 1
    interpolation: str = "bilinear"


def encoded(source: Any, box: tuple[float, float, float, float], size: int, flip: bool, orientation: int,
            interpolation: str = "bilinear") -> Encoded:  # fmt: skip
    """An image file (a path) or its bytes as an :class:`Encoded`, not decoded."""
    data = bytes(source) if isinstance(source, (bytes, bytearray, memoryview)) else Path(source).read_bytes()
    return Encoded(torch.frombuffer(bytearray(data), dtype=torch.uint8), box, size, flip, orientation, interpolation)


class EncodedBatch:
    """A batch whose images are :class:`Encoded` JPEGs and, where the worker decoded
    one itself, ``uint8 3 x S x S`` tensors."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)


def stack_images(images: list[Any]) -> torch.Tensor | EncodedBatch:
    """``torch.stack`` of a batch's images, or an :class:`EncodedBatch` where any is encoded."""
    if any(isinstance(image, Encoded) for image in images):
        return EncodedBatch(images)
    return torch.stack(images)


def collate(items: list[tuple[Any, int]]) -> tuple[torch.Tensor | EncodedBatch, torch.Tensor]:
    """The DataLoader's collate for (image, int) items some of which are encoded."""
    return stack_images([image for image, _ in items]), torch.tensor([int(t) for _, t in items], dtype=torch.int64)


def orient(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """A ``C x H x W`` image as EXIF ``orientation`` says it stands upright (as Pillow's
    transposes in :mod:`slipstream.data.geometry`)."""
    if orientation == 2:
        return image.flip(-1)
    if orientation == 3:
        return image.flip(-1, -2)
    if orientation == 4:
        return image.flip(-2)
    if orientation == 5:
        return image.transpose(-1, -2)
    if orientation == 6:
        return torch.rot90(image, -1, (-2, -1))
    if orientation == 7:
        return image.transpose(-1, -2).flip(-1, -2)
    if orientation == 8:
        return torch.rot90(image, 1, (-2, -1))
    return image


def cut(image: torch.Tensor, item: Encoded) -> torch.Tensor:
    """A decoded ``3 x H x W`` image cut as ``item`` says, where it is (CPU or GPU)."""
    from torchvision.transforms import InterpolationMode, v2

    image = orient(image, item.orientation)
    # Pillow resizes a fractional box; a slice needs whole pixels (a random resized
    # crop's box is whole already, a centre crop's moves by under half a pixel).
    left, top, right, bottom = (round(v) for v in item.box)
    out = v2.functional.resize(
        image[:, top:bottom, left:right],
        [item.size, item.size],
        interpolation=InterpolationMode(item.interpolation),
        antialias=True,
    )
    return out.flip(-1) if item.flip else out


def decode_batch(batch: EncodedBatch, device: torch.device | str) -> torch.Tensor:
    """The ``uint8 N x 3 x S x S`` batch on ``device``: the JPEGs decoded together there
    (nvJPEG on a CUDA device, libjpeg on the CPU) and cut, the worker's own decodes
    copied in at their places."""
    from torchvision.io import ImageReadMode, decode_jpeg

    device = torch.device(device)
    jpegs = [(i, item) for i, item in enumerate(batch.items) if isinstance(item, Encoded)]
    size = jpegs[0][1].size if jpegs else batch.items[0].shape[-1]
    out = torch.empty((len(batch), 3, size, size), dtype=torch.uint8, device=device)
    try:
        decoded = decode_jpeg([item.data for _, item in jpegs], mode=ImageReadMode.RGB, device=device) if jpegs else []
    except RuntimeError:  # one JPEG nvJPEG cannot read fails the whole call: each alone, then Pillow
        decoded = None
    for k, (i, item) in enumerate(jpegs):
        out[i] = cut(decoded[k], item) if decoded is not None else _decode_alone(item, device)
    if len(jpegs) < len(batch):
        _say_once(
            "fallback",
            "slipstream: data.decode=gpu: some images are not baseline RGB JPEGs (PNG or another format, or a "
            "greyscale or CMYK JPEG, which nvJPEG is not given): those are decoded on the CPU in the loader's "
            "workers (said once)",
        )
        for i, item in enumerate(batch.items):
            if not isinstance(item, Encoded):
                out[i] = item.to(device, non_blocking=True)
    return out


def _decode_alone(item: Encoded, device: torch.device) -> torch.Tensor:
    """A JPEG of a batch nvJPEG failed on, cut: decoded alone on ``device``, else by Pillow
    on the CPU; a DataError where neither can read it."""
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return cut(decode_jpeg(item.data, mode=ImageReadMode.RGB, device=device), item)
    except RuntimeError:
        pass
    _say_once("alone", "slipstream: data.decode=gpu: nvJPEG could not read a JPEG; it and any other such are "
                       "decoded by Pillow on the CPU in the main process (said once)")  # fmt: skip
    import io

    import numpy as np
    from PIL import Image

    from slipstream.data.decode import _reason
    from slipstream.errors import DataError

    try:
        with Image.open(io.BytesIO(item.data.numpy().tobytes())) as image:
            array = np.array(image.convert("RGB"))  # an Encoded is an RGB JPEG's: 8-bit already
    except (OSError, SyntaxError, ValueError) as err:
        raise DataError(
            f"data.decode=gpu: a JPEG of this batch cannot be decoded ({_reason(err)}); data.decode=cpu names "
            "unreadable images and trains on without them"
        ) from None
    return cut(torch.from_numpy(array).permute(2, 0, 1), item).to(device)


def _say_once(what: str, line: str) -> None:
    if what not in _said:
        _said.add(what)
        print(line, file=sys.stderr)


def _decode_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def device_batches(batches: Iterable[Any], device: torch.device | None = None) -> Iterator[Any]:
    """``batches`` with each :class:`EncodedBatch` decoded on ``device`` (None: this
    process's CUDA device); the others as they come."""
    for batch in batches:
        if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], EncodedBatch):
            device = device or _decode_device()
            batch = (decode_batch(batch[0], device), *batch[1:])
        yield batch


class DeviceDecodingLoader(DataLoader):
    """A DataLoader whose batches of encoded JPEGs are decoded on the GPU as they are
    taken (still a DataLoader: its sampler, length and workers are the loader's own)."""

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return device_batches(super().__iter__())


# -- auto ------------------------------------------------------------------------------


def geometry_of(loader: Any) -> Any:
    """The geometry a loader's images are cut with (None: its data is not cut from files)."""
    for holder in (getattr(loader, "dataset", None), getattr(loader, "source", None)):
        geometry = getattr(holder, "geometry", None)
        if geometry is not None:
            return geometry
    return None


def _fetcher(loader: Any, count: int) -> tuple[Any, int]:
    """A function that reads and cuts the loader's first ``count`` samples of epoch 0 as
    its workers do, and how many it reads."""
    from slipstream.data.sampler import SampleKey

    dataset = getattr(loader, "dataset", None)
    source = getattr(loader, "source", None)
    if source is not None and hasattr(source, "read"):
        raws = []
        for shard in range(len(source.shard_sizes)):
            raws.extend(source.read(shard, 0, min(source.shard_sizes[shard], count - len(raws))))
            if len(raws) >= count:
                break
        return (lambda: [source.decode(raw)[0] for raw in raws]), len(raws)
    keys = [SampleKey(i, 0) for i in range(min(count, len(dataset)))]
    return (lambda: [dataset[key][0] for key in keys]), len(keys)


def _best_time(run: Any, rounds: int, sync: Any) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - started)
    return best


def measure_decode(loader: Any, device: torch.device, *, samples: int = 64, rounds: int = 2) -> dict[str, float]:
    """Images per second of the loader's data both ways, from its first ``samples``
    samples timed in this process (``rounds`` each, the fastest counts): the CPU path is
    the workers' full decode, times the workers; the GPU path is the slower of the
    workers' header reads and the main process's batched decode and cut on ``device``."""
    switch = geometry_of(loader).switch
    workers = max(1, int(getattr(loader, "num_workers", 0) or 0))
    fetch, count = _fetcher(loader, samples)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    before = switch.on
    try:
        switch.on = False
        fetch()  # warm: the files in the page cache, as in the other two rounds
        cpu_s = _best_time(fetch, rounds, sync)
        switch.on = True
        batch = stack_images(fetch())
        if not isinstance(batch, EncodedBatch):
            batch = EncodedBatch(list(batch))
        decode_batch(batch, device)  # warm: CUDA's and nvJPEG's start
        bytes_s = _best_time(fetch, rounds, sync)
        gpu_s = _best_time(lambda: decode_batch(batch, device), rounds, sync)
    finally:
        switch.on = before
    return {
        "cpu": count * workers / cpu_s,
        "gpu": min(count * workers / bytes_s, count / gpu_s),
        "samples": count,
        "workers": workers,
    }


def choose_decode(value: Any, loaders: Iterable[Any], device: torch.device, *, verbose: bool = True) -> dict | None:
    """Settle ``data.decode`` for a run's ``loaders`` (training first) on ``device``: the
    record of an ``auto`` choice (for summary.json's ``decode`` entry; None for cpu and
    gpu, which are what they say). ``gpu`` with the run on another device is a ConfigError."""
    from slipstream.distributed import from_rank0

    value = "cpu" if value is None else value
    loaders = [loader for loader in loaders if loader is not None]
    switches = [g.switch for g in map(geometry_of, loaders) if g is not None and g.switch is not None]
    if value == "gpu" and device.type != "cuda":
        raise ConfigError(
            f"data.decode=gpu needs the run on a CUDA device, and it runs on {device}; use data.decode=cpu"
        )
    if value != "auto":
        return None
    started = time.perf_counter()
    record: dict[str, Any] = {"choice": "cpu"}
    if device.type != "cuda":
        record["method"] = f"fallback (no CUDA device: the run is on {device}, and nvJPEG decodes on CUDA only)"
    elif not switches or getattr(geometry_of(loaders[0]), "switch", None) is None:
        record["method"] = "fallback (this data's images are not decoded from files: nothing to decode on the GPU)"
    else:
        rates = measure_decode(loaders[0], device)
        faster = rates["gpu"] > rates["cpu"] * (1 + GPU_MARGIN)
        record.update(choice="gpu" if faster else "cpu", method="measured", images_per_s={
            "cpu": round(rates["cpu"], 1), "gpu": round(rates["gpu"], 1)})  # fmt: skip
        record["how"] = (
            f"{rates['samples']} samples cut both ways in this process, the fastest of 2 rounds; "
            f"the CPU's rate times {rates['workers']} workers, the GPU's the slower of the workers' header "
            "reads and the batched decode"
        )
    record["choice"] = from_rank0(record["choice"])  # every rank cuts as rank 0 chose
    for switch in switches:
        switch.on = record["choice"] == "gpu"
    record["margin"] = GPU_MARGIN
    record["cost_s"] = round(time.perf_counter() - started, 3)
    if verbose:
        print(describe(record), file=sys.stderr)
    return record


def describe(record: dict[str, Any]) -> str:
    """The one line a run prints about its ``data.decode=auto`` choice."""
    line = f"slipstream: auto: data.decode={record['choice']} ({record['method']}"
    rates = record.get("images_per_s")
    if rates:
        line += f"; cpu {rates['cpu']:.0f} images/s, gpu {rates['gpu']:.0f} images/s; gpu only if >10% faster"
    return line + f"; took {record['cost_s']:.2f} s, outside the run's clock)"
