"""On a GPU: data.decode=gpu decodes each batch's JPEGs with nvJPEG on the device and
cuts the crops the workers drew, giving the CPU path's batch (the same boxes and flips;
pixels within what another JPEG decoder gives), already on the GPU; data.decode=auto
measures both and reports its choice."""

from __future__ import annotations

import numpy as np
import torch
from cuda_common import CUDA

from slipstream.data import gpu_decode
from test_decode_gpu import _built, _tree

pytestmark = CUDA


def test_gpu_decode_gives_the_cpu_paths_batches_on_the_device(tmp_path):
    """Tolerance: nvJPEG's IDCT and chroma upsampling are not libjpeg-turbo's (a level
    or two on smooth areas, more at sharp edges), and its crop boxes are whole pixels:
    at most 3 levels of 255 on average and a PSNR above 30 dB, where a wrong box or
    flip is tens of levels off."""
    root = _tree(tmp_path)
    cpu, gpu = _built(root, "cpu"), _built(root, "gpu", workers=2)
    assert type(gpu.train).__name__ == "DeviceDecodingLoader"
    for loader in (cpu.train, gpu.train, cpu.eval, gpu.eval):
        loader.sampler.set_epoch(1)
    for (a, _), (b, _) in zip([*cpu.train, *cpu.eval], [*gpu.train, *gpu.eval], strict=True):
        assert b.is_cuda and b.dtype == torch.uint8 and b.shape == a.shape
        mse = (a.float() - b.cpu().float()).pow(2).mean().item()
        assert (a.float() - b.cpu().float()).abs().mean() < 3 and 10 * np.log10(255**2 / max(mse, 1e-9)) > 30


def test_auto_measures_both_and_switches_the_workers(tmp_path, capsys):
    built = _built(_tree(tmp_path, 16), "auto", workers=2)
    record = gpu_decode.choose_decode("auto", (built.train, built.eval), torch.device("cuda", 0))
    assert record["method"] == "measured" and set(record["images_per_s"]) == {"cpu", "gpu"}
    assert gpu_decode.geometry_of(built.train).switch.on == (record["choice"] == "gpu")
    assert f"data.decode={record['choice']} (measured; cpu" in capsys.readouterr().err
    built.train.sampler.set_epoch(0)
    images, _ = next(iter(built.train))
    assert images.is_cuda == (record["choice"] == "gpu") and images.shape[-1] == 24
