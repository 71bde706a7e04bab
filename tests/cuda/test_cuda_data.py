"""On a GPU: the lean batch path (uint8 batches pinned on the host, copied from pinned
memory, converted and normalised on the device) and gpu_augmentation on the device
with no host copies per batch."""

from __future__ import annotations

import warnings

import torch
from cuda_common import CUDA, fit_cuda, synthetic_loaders
from slipstream_gpu_augmentation import (
    GpuAugmentation,
    GpuAugmentationConfig,
    augment_batch,
    build_augmentation,
    place_pipeline,
)
from torch.profiler import ProfilerActivity, profile

from helpers import Probe
from slipstream.config.schema import build_config
from slipstream.run.build import build_trainer
from slipstream.services.batches import batch_mover

pytestmark = CUDA
MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)


class RecordingLoader:
    """A DataLoader as the Trainer sees it, recording every host batch it yields."""

    def __init__(self, loader) -> None:
        self.loader, self.sampler, self.batch_size = loader, loader.sampler, loader.batch_size
        self.host: list[tuple[bool, torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            self.host.append((batch[0].is_pinned(), batch[0].clone()))
            yield batch


def _memcpy_events(prof) -> list[str]:
    return [e.name for e in prof.events() if "memcpy" in e.name.lower() and ("HtoD" in e.name or "DtoH" in e.name)]


def _syncs(fn) -> list[str]:
    """Where ``fn`` synchronises with the device (torch's sync debug mode warns there):
    for each warning, the innermost three frames outside torch, which name the caller."""
    import traceback

    places: set[str] = set()

    def remember(message, *_args, **_kwargs) -> None:
        if "synchroniz" not in str(message):  # setting the mode warns too
            return
        stack = traceback.extract_stack()[:-1]
        frames = [f for f in stack if not ("/torch/" in f.filename or f.filename.endswith("warnings.py"))]
        places.add(" <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in reversed(frames[-3:])))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = remember
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sorted(places)


def test_uint8_batch_arrives_pinned_and_is_normalised_on_the_device(tmp_path):
    train, val = synthetic_loaders(pin_memory=True)
    recording = RecordingLoader(train)
    seen: dict = {"start": [], "model": []}

    def batch_start(state):
        x = state.batch[0]
        seen["start"].append((x.device.type, x.dtype))

    def before_forward(state):
        seen["model"].append(state.batch[0].detach().clone())

    fit_cuda(
        tmp_path,
        [Probe(batch_start=batch_start, before_forward=before_forward)],
        loaders=(recording, val),
        max_duration="3ba",
        normalize=(MEAN, STD),
    )
    assert [pinned for pinned, _ in recording.host] == [True] * 3
    assert seen["start"] == [("cuda", torch.uint8)] * 3  # moved as uint8: a quarter of float's bytes
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    for (_, host), on_device in zip(recording.host, seen["model"], strict=True):
        assert on_device.is_cuda and on_device.dtype == torch.float32
        torch.testing.assert_close(on_device.cpu(), (host.float() / 255 - mean) / std, rtol=1e-5, atol=1e-5)


def test_the_cli_pins_batches_and_copies_them_from_pinned_memory(tmp_path):
    cfg = build_config(
        "default",
        None,
        [
            "data.train_size=64", "data.val_size=32", "data.image_size=16", "data.batch_size=32",
            "trainer.device=cuda", f"trainer.run_dir={tmp_path / 'run'}", "trainer.progress_bar=false",
        ],
    )
    trainer = build_trainer(cfg, verbose=False)
    loader = trainer.state.train_loader
    assert loader.pin_memory is True
    loader.sampler.set_epoch(0, start_batch=0)
    batch = next(iter(loader))
    assert batch[0].is_pinned() and batch[0].dtype == torch.uint8
    move = batch_mover(torch.device("cuda", torch.cuda.current_device()))
    move(batch)  # warm-up: the first copy sets up the stream
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        moved = move(batch)
        torch.cuda.synchronize()
    copies = [name for name in _memcpy_events(prof) if "HtoD" in name]
    assert copies, [e.name for e in prof.events()][:50]
    assert all("Pinned" in name for name in copies), copies  # not "Pageable": a true async copy
    assert moved[0].is_cuda and torch.equal(moved[0].cpu(), batch[0])


def test_gpu_augmentation_runs_on_the_device_without_host_copies(tmp_path):
    # No copy at all in either preset. trivial: TrivialAugment draws one of kornia's
    # operations per batch; brightness and contrast (2 of its 12) kept their ranges on
    # the host and went through it (kornia 0.9, found on an H100 with sync debug mode):
    # 20 batches, so that a draw of either is all but certain.
    allowed = {"light": 0, "trivial": 0}
    device = torch.device("cuda", torch.cuda.current_device())
    for preset in ("light", "trivial"):
        pipeline = place_pipeline(build_augmentation(GpuAugmentationConfig(preset=preset)), device)
        images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8, device=device)
        for seed in range(2):  # warm-up: crops are built per input size at the first batch
            augment_batch(images, pipeline, seed)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            outs = [augment_batch(images, pipeline, seed) for seed in range(2, 22)]
            torch.cuda.synchronize()
        copies = _memcpy_events(prof)
        assert len(copies) <= allowed[preset], (
            f"{preset}: {len(copies)} host copies in 20 batches: {sorted(set(copies))}; synchronising calls at "
            f"{_syncs(lambda x=images, p=pipeline: [augment_batch(x, p, seed) for seed in range(2, 22)])}"
        )
        assert all(o.is_cuda and o.dtype == torch.float32 and o.shape == images.shape for o in outs)
        assert not torch.equal(outs[0], outs[1])  # random per batch
    # Through the engine: the batch is augmented where it is, before normalisation.
    seen = []
    probe = Probe(before_forward=lambda s: seen.append((s.batch[0].device.type, s.batch[0].dtype)))
    fit_cuda(tmp_path, [GpuAugmentation(), probe], max_duration="2ba")
    assert seen == [("cuda", torch.float32)] * 2


def test_the_cli_trains_the_default_recipe_on_cuda(tmp_path):
    import json
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable, "-m", "slipstream", "train",
            "data.train_size=256", "data.val_size=64", "data.image_size=32", "data.batch_size=64",
            "trainer.max_duration=2ep", "trainer.device=cuda", "trainer.progress_bar=false",
            f"trainer.run_dir={run_dir}",
        ],
        capture_output=True, text=True, timeout=150,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["device"].startswith("cuda")
    assert summary["device_name"] == torch.cuda.get_device_name()
    # The default recipe's mixed_precision is dtype auto: on CUDA it times bf16 against
    # fp32 and keeps bf16 only where it is clearly faster (on an H100 a model this
    # small is launch-bound, and fp32 won); the run computes in what it chose.
    auto = summary["auto"]
    assert auto["variants"]["mixed_precision"] == ["bf16", "fp32"], auto
    assert auto["method"] in ("measured", "cache"), auto
    assert summary["compute_dtype"] == auto["choice"]["mixed_precision"], auto
    assert 0 < summary["mfu"] < 1
    assert summary["accuracy"] is not None and summary["peak_memory_mb"] > 0
