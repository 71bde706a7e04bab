"""data.decode=gpu, tested on the CPU: the workers hand over JPEG bytes with the crop
they drew (no decode), and ``decode_batch`` (parameterised by the device) decodes the
batch with ``torchvision.io.decode_jpeg`` and cuts it as the PIL path does. On a GPU
the same function runs with nvJPEG (tests/cuda/test_cuda_decode.py)."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import TINY_RUN, error_lines
from slipstream.cli.main import main
from slipstream.config.schema import build_config
from slipstream.data import DataRequest, Geometry, SampleKey, build_dataset_plugin, gpu_decode
from slipstream.data.geometry import geometries
from slipstream.data.gpu_decode import DecodeSwitch, Encoded, EncodedBatch, decode_batch, orient
from slipstream.errors import ConfigError
from test_geometry import _jpeg, photo

# torchvision.io's decoders are deprecated for TorchCodec (0.29); they are what nvJPEG is reached by.
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding:DeprecationWarning")
ON = DecodeSwitch("gpu", True)
JPEG = _jpeg(photo(7, (240, 180)), 90)


def keys(epoch: int = 3, count: int = 8) -> list[SampleKey]:
    return [SampleKey(i, epoch) for i in range(count)]


def test_the_workers_read_bytes_and_draw_the_crops_the_pil_path_draws():
    geometry = Geometry(32, crop="random_resized", hflip=0.5, seed=4)
    deferred = replace(geometry, switch=ON)
    items = [deferred.load(JPEG, key) for key in keys()]
    assert all(isinstance(item, Encoded) and bytes(item.data.numpy()) == JPEG for item in items)
    for key, item in zip(keys(), items, strict=True):
        rng = geometry.generator(key)  # what load() draws, in its order: the box, then the flip
        assert item.box == geometry.box(240, 180, rng) and item.flip == (rng.random() < 0.5)
    assert len({item.box for item in items}) == len(items) and {item.flip for item in items} == {True, False}
    # Switched off (auto chose the CPU), the same geometry decodes as before.
    assert isinstance(replace(geometry, switch=DecodeSwitch("auto", False)).load(JPEG, keys()[0]), torch.Tensor)


@pytest.mark.parametrize(("crop", "interpolation"), [("random_resized", "bilinear"), ("center", "bicubic")])
def test_decoding_the_batch_gives_the_pil_paths_crops(crop, interpolation):
    """Tolerance: both decode with libjpeg-turbo and torchvision's antialiased resize is
    Pillow's filter, so a random resized crop (a whole-pixel box) differs by 0.01 levels
    of 255 on average here, a few pixels at the disc's edge by up to 10 (rounding where
    the two resize kernels differ); a centre crop's fractional box moves under half a
    pixel on the GPU path (0.2 levels on average). So: under half a level on average and
    a PSNR over 35 dB (what tests/test_geometry.py holds reduced-size decoding to: not
    visible), where a wrong box, flip or orientation is tens of levels off (checked
    below). Reduced-size decoding is off on the PIL side: nvJPEG decodes the whole image."""
    geometry = Geometry(32, crop=crop, hflip=0.5, interpolation=interpolation, crop_pct=0.875, reduced_decoding=False)
    pil = torch.stack([geometry.load(JPEG, key) for key in keys()])
    batch = EncodedBatch([replace(geometry, switch=ON).load(JPEG, key) for key in keys()])
    out = decode_batch(batch, "cpu")
    assert out.dtype == torch.uint8 and out.shape == (8, 3, 32, 32)
    diff = (out.float() - pil.float()).abs()
    assert diff.mean() < 0.5 and 10 * np.log10(255**2 / max(diff.pow(2).mean().item(), 1e-9)) > 35
    wrong = EncodedBatch([item._replace(flip=not item.flip) for item in batch.items])
    assert (decode_batch(wrong, "cpu").float() - pil.float()).abs().mean() > 10


def test_exif_orientations_turn_as_pillow_turns():
    image = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3) * 7  # H x W x C, not square
    tensor = torch.from_numpy(image).permute(2, 0, 1)
    from slipstream.data.geometry import _ORIENTATIONS

    for tag, transpose in _ORIENTATIONS.items():
        want = np.asarray(Image.fromarray(image).transpose(transpose))
        assert np.array_equal(orient(tensor, tag).permute(1, 2, 0).numpy(), want), tag


def test_what_nvjpeg_is_not_given_is_decoded_in_the_worker_and_said_once(capsys, monkeypatch):
    monkeypatch.setattr(gpu_decode, "_said", set())
    geometry = Geometry(16, crop="none", reduced_decoding=False, switch=ON)
    png, grey, cmyk = io.BytesIO(), io.BytesIO(), io.BytesIO()
    photo(1).save(png, "PNG")
    photo(1).convert("L").save(grey, "JPEG")
    photo(1).convert("CMYK").save(cmyk, "JPEG")
    items = [geometry.load(data) for data in (JPEG, png.getvalue(), grey.getvalue(), cmyk.getvalue())]
    assert [type(item).__name__ for item in items] == ["Encoded", "Tensor", "Tensor", "Tensor"]
    for _ in range(2):
        out = decode_batch(EncodedBatch(items), "cpu")
    assert out.shape == (4, 3, 16, 16) and torch.equal(out[1], items[1])
    assert capsys.readouterr().err.count("decoded on the CPU in the loader's workers") == 1


def _tree(tmp_path, count: int = 8):
    for split in ("train", "val"):
        for i in range(count):
            folder = tmp_path / split / f"c{i % 2}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{i}.jpg").write_bytes(_jpeg(photo(i), 92))
    return tmp_path


def _built(root, decode: str, workers: int = 0):
    cfg = build_config(None, None, ["data.name=imagefolder", f"data.root={root}", "data.image_size=24",
                                    "data.reduced_decoding=false", f"data.decode={decode}"])  # fmt: skip
    train, evaluation = geometries(cfg.data, True, seed=5)
    request = DataRequest(image_size=24, batch_size=4, eval_batch_size=4, num_workers=workers, seed=5,
                          train_geometry=train, eval_geometry=evaluation)  # fmt: skip
    return build_dataset_plugin(dict(cfg.data)).build(request)


def test_the_loader_gives_the_cpu_paths_batches_decoded_on_the_device(tmp_path, monkeypatch):
    root = _tree(tmp_path)
    cpu = _built(root, "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the config's check; batches decode on "cpu"
    monkeypatch.setattr(gpu_decode, "_decode_device", lambda: torch.device("cpu"))
    gpu = _built(root, "gpu", workers=1)
    assert type(gpu.train).__name__ == "DeviceDecodingLoader" and type(cpu.train).__name__ == "DataLoader"
    for loader in (cpu.train, gpu.train, cpu.eval, gpu.eval):
        loader.sampler.set_epoch(2)
    pairs = [(a, b) for (a, _), (b, _) in zip([*cpu.train, *cpu.eval], [*gpu.train, *gpu.eval], strict=True)]
    for a, b in pairs:
        assert a.shape == b.shape and b.dtype == torch.uint8
        assert (a.float() - b.float()).abs().mean() < 1  # the same crops (the eval's centre box rounded)


def test_auto_without_cuda_is_the_cpu_and_says_why(tmp_path, capsys):
    built = _built(_tree(tmp_path, 2), "auto")
    assert gpu_decode.geometry_of(built.train).switch is None  # no CUDA: nothing to switch
    record = gpu_decode.choose_decode("auto", (built.train, built.eval), torch.device("cpu"))
    assert record["choice"] == "cpu" and record["method"].startswith("fallback (no CUDA device")
    assert "data.decode=cpu (fallback (no CUDA device" in capsys.readouterr().err
    assert gpu_decode.choose_decode("cpu", (built.train,), torch.device("cpu")) is None
    from slipstream.data import build_datasets, build_loader

    shapes = build_loader(build_datasets("synthetic", image_size=8, train_size=8, val_size=4)[0], batch_size=4)
    record = gpu_decode.choose_decode("auto", (shapes,), torch.device("cuda"), verbose=False)  # nothing timed
    assert record["choice"] == "cpu" and "not decoded from files" in record["method"]


def test_auto_measures_both_ways_on_the_runs_data(tmp_path, monkeypatch):
    root = _tree(tmp_path, 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    built = _built(root, "auto", workers=2)
    switch = gpu_decode.geometry_of(built.train).switch
    assert switch.mode == "auto" and not switch.on
    rates = gpu_decode.measure_decode(built.train, torch.device("cpu"), samples=4, rounds=1)
    assert rates["cpu"] > 0 and rates["gpu"] > 0 and rates["workers"] == 2 and rates["samples"] == 4
    assert not switch.on  # left as it was


def test_an_auto_run_reports_its_choice_in_the_summary(tmp_path):
    from slipstream.config.schema import build_run
    from slipstream.run.build import build_trainer

    spec = build_run(None, None, [*TINY_RUN, "data.decode=auto", f"trainer.run_dir={tmp_path / 'run'}"])
    trainer = build_trainer(spec, verbose=False)
    assert trainer.state.summary["decode"]["choice"] == "cpu"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.decode=gpu", "data.decode=gpu needs a CUDA device, and torch.cuda.is_available() is False"),
        ("data.decode=nvjpeg", "data.decode must be one of cpu, gpu, auto, got 'nvjpeg'"),
    ],
)
def test_bad_decode_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, monkeypatch, override, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError):
        build_config(None, None, [override])
    assert main(["train", *TINY_RUN, override, f"trainer.run_dir={tmp_path / 'run'}"]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_gpu_with_the_run_on_the_cpu_is_refused(tmp_path):
    built = _built(_tree(tmp_path, 2), "cpu")
    with pytest.raises(ConfigError, match="needs the run on a CUDA device, and it runs on cpu"):
        gpu_decode.choose_decode("gpu", (built.train,), torch.device("cpu"))
    assert json.dumps(gpu_decode.describe({"choice": "cpu", "method": "measured", "cost_s": 0.1}))


def test_shards_decode_on_the_device_and_take_a_told_size(tmp_path, monkeypatch):
    """The stream loader (webdataset): encoded items stacked per batch and decoded in
    the main process; told sizes per batch, its workers cut at the largest (they start
    once per epoch with one size)."""
    from slipstream_webdataset import convert_imagefolder

    from slipstream.data import output_size_of, set_output_size

    shards = convert_imagefolder(str(_tree(tmp_path / "tree")), str(tmp_path / "wds"), shard_size=10**5, progress=False)

    def built(decode: str, workers: int = 0):
        cfg = build_config(None, None, ["data.name=webdataset", f"data.urls={shards['urls']}", "data.image_size=24",
                                        "data.reduced_decoding=false", f"data.decode={decode}"])  # fmt: skip
        train, evaluation = geometries(cfg.data, True, seed=1)
        request = DataRequest(image_size=24, batch_size=4, num_workers=workers, seed=1, train_geometry=train,
                              eval_geometry=evaluation)  # fmt: skip
        return build_dataset_plugin(dict(cfg.data)).build(request).train

    cpu = built("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_decode, "_decode_device", lambda: torch.device("cpu"))
    gpu = built("gpu", workers=1)
    for loader in (cpu, gpu):
        loader.set_epoch(1)
    a, b = (torch.cat([images for images, _ in loader]) for loader in (cpu, gpu))
    assert a.shape == b.shape == (8, 3, 24, 24) and (a.float() - b.float()).abs().mean() < 0.5
    assert set_output_size(cpu, [12, 14]) and output_size_of(cpu) == 24
    cpu.set_epoch(1)
    assert [images.shape[-1] for images, _ in cpu] == [14, 14]
    set_output_size(cpu, None)
    cpu.set_epoch(1)
    assert torch.equal(torch.cat([images for images, _ in cpu]), a)


def test_a_jpeg_the_batched_decode_fails_on_is_decoded_alone_or_by_pillow(monkeypatch, capsys):
    import torchvision.io

    from slipstream.errors import DataError

    monkeypatch.setattr(gpu_decode, "_said", set())
    geometry = Geometry(16, crop="center", reduced_decoding=False, switch=ON)
    good = decode_batch(EncodedBatch([geometry.load(JPEG), geometry.load(JPEG)]), "cpu")
    real = torchvision.io.decode_jpeg

    def failing(data, **kwargs):  # nvJPEG failing on the batch, and on one image alone
        if isinstance(data, list) or data.numel() % 2:
            raise RuntimeError("nvjpeg: unsupported")
        return real(data, **kwargs)

    monkeypatch.setattr(torchvision.io, "decode_jpeg", failing)
    odd = geometry.load(JPEG + b"\0" if len(JPEG) % 2 == 0 else JPEG)  # a trailing byte: still the same JPEG
    even = geometry.load(JPEG + b"\0" if len(JPEG) % 2 else JPEG)
    out = decode_batch(EncodedBatch([odd, even]), "cpu")
    assert (out.float() - good.float()).abs().mean() < 0.5  # Pillow's cut of the odd one, the lone decode of the other
    assert capsys.readouterr().err.count("decoded by Pillow on the CPU") == 1
    broken = odd._replace(data=odd.data[: len(odd.data) // 3])
    with pytest.raises(DataError, match="a JPEG of this batch cannot be decoded"):
        decode_batch(EncodedBatch([broken]), "cpu")
