"""On a GPU: torch.compile compiles once at a fixed size (CUDA graphs off and on),
summary.json's peak memory and MFU, activation checkpointing's saving, and an exact
mid-epoch resume."""

from __future__ import annotations

import gc
import json
import warnings

import pytest
import torch
from cuda_common import CUDA, MIB, fit_cuda, small_model, synthetic_loaders
from slipstream_activation_checkpointing import ActivationCheckpointing
from slipstream_mixed_precision import MixedPrecision, MixedPrecisionConfig
from slipstream_torch_compile import TorchCompile, TorchCompileConfig

from slipstream.models import build_model
from slipstream.services.peak_flops import peak_flops

pytestmark = CUDA

# Dense tensor-core peaks by the vendor's datasheets (TFLOP/s, bf16 and fp32 without
# TF32), for the names torch.cuda.get_device_name reports; the probe lands below them.
DATASHEET = {"H100": (989, 67), "H200": (989, 67), "A100": (312, 19.5), "L4": (121, 30), "A10G": (70, 31)}


@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["default", "cudagraphs"])
def test_torch_compile_compiles_once_at_a_fixed_size(tmp_path, mode):
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit_cuda(tmp_path, [TorchCompile(TorchCompileConfig(mode=mode))], max_duration="8ba")
    assert not [str(w.message) for w in caught if "compiled again" in str(w.message)]
    stats = trainer.summary["compile"]
    assert stats["compiling_steps"] == 1, stats  # the first batch only, not again per batch
    assert stats["compiles"] >= 1 and stats["mode"] == (mode or "default")
    assert trainer.summary["status"] == "completed" and trainer.summary["samples"] == 8 * 32


def test_summary_has_cuda_peak_memory_and_a_plausible_mfu(tmp_path):
    trainer = fit_cuda(tmp_path, [MixedPrecision(MixedPrecisionConfig(dtype="bf16"))], max_duration="6ba")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # Reset at the start of training and read at its end: nothing after fit allocated more.
    assert summary["peak_memory_mb"] == pytest.approx(torch.cuda.max_memory_allocated() / MIB, abs=0.1)
    weights = sum(p.numel() * p.element_size() for p in trainer.state.unwrapped_model.parameters()) / MIB
    assert summary["peak_memory_mb"] > weights
    assert summary["compute_dtype"] == "bf16" and 0 < summary["mfu"] < 1
    assert summary["device"].startswith("cuda") and summary["device_name"] == torch.cuda.get_device_name()
    peak = summary["peak_tflops"]
    assert peak["bf16"] > peak["fp32"] > 1  # tensor cores: bf16 far above plain fp32


def test_an_fp32_convnet_is_measured_against_the_tf32_peak(tmp_path):
    # cuDNN runs fp32 convolutions on TF32 tensor cores by default: against the true
    # fp32 peak a ResNet-18 showed 120 % MFU on an H100.
    assert torch.backends.cudnn.allow_tf32
    fit_cuda(tmp_path, [], max_duration="6ba")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["compute_dtype"] == "fp32" and summary["peak_dtype"] == "tf32"
    assert 0 < summary["mfu"] < 1


def test_the_probed_peak_is_plausible_for_the_device(tmp_path):
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # the probe sets TF32 itself, and puts this back
    try:
        peak = peak_flops(torch.device("cuda"), path=tmp_path / "peak.json").tflops()
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(previous)
    assert peak["tf32"] > 2 * peak["fp32"], peak  # TF32 tensor cores: several times plain fp32
    name = torch.cuda.get_device_name()
    sheet = next((v for k, v in DATASHEET.items() if k in name), None)
    if sheet is None:
        pytest.skip(f"no datasheet figure for {name!r}; probed {peak}")
    bf16, fp32 = sheet
    # An H100's large bf16 matmul reaches ~800 of the datasheet's 989 (about 80 %).
    assert 0.5 * bf16 <= peak["bf16"] <= 1.05 * bf16, (name, peak)
    assert 0.5 * fp32 <= peak["fp32"] <= 1.05 * fp32, (name, peak)


def test_activation_checkpointing_lowers_the_measured_peak(tmp_path):
    def peak(run: str, algorithms: list) -> float:
        gc.collect()  # the first run's model and optimizer: not in the second run's peak
        torch.cuda.empty_cache()
        torch.manual_seed(0)
        model = build_model("resnet18", 4, image_size=64, cifar_stem=True)
        loaders = synthetic_loaders(n=64, image_size=64, batch_size=64)
        trainer = fit_cuda(tmp_path / run, algorithms, model=model, loaders=loaders, max_duration="2ba")
        assert trainer.summary["peak_memory_mb"] is not None
        return trainer.summary["peak_memory_mb"]

    plain = peak("plain", [])
    checkpointed = peak("checkpointed", [ActivationCheckpointing()])
    assert checkpointed < 0.8 * plain, (checkpointed, plain)


@pytest.fixture
def _restore_determinism():
    # A deterministic run switches torch's global mode on and leaves it (a user's choice).
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.usefixtures("_restore_determinism")
def test_a_mid_epoch_resume_is_bit_exact_with_deterministic_settings(tmp_path):
    def run(name: str, **kwargs) -> dict[str, torch.Tensor]:
        model = small_model()
        trainer = fit_cuda(
            tmp_path / name,
            model=model,
            loaders=synthetic_loaders(n=192, batch_size=32),  # 6 batches an epoch
            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
            deterministic=True,
            **kwargs,
        )
        return {k: v.detach().cpu() for k, v in trainer.state.unwrapped_model.state_dict().items()}

    whole = run("whole", max_duration="8ba", checkpoint_interval="3ba", checkpoint_keep=5)
    ckpt = tmp_path / "whole" / "run" / "checkpoints"
    mid = sorted(ckpt.glob("*ba3.pt"))
    assert mid, sorted(p.name for p in ckpt.iterdir())
    resumed = run("resumed", max_duration="8ba", load_path=mid[0])
    assert whole.keys() == resumed.keys()
    different = [k for k in whole if not torch.equal(whole[k], resumed[k])]
    assert different == []
