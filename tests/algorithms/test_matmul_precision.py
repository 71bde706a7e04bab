"""matmul_precision: process-wide matmul/cuDNN settings for the run, restored after."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from slipstream_matmul_precision import (
    MatmulPrecision,
    MatmulPrecisionConfig,
    MatmulSettings,
    set_matmul_precision,
)

from helpers import Probe, train
from slipstream import ConfigError
from slipstream.plugins.discovery import plugin_config
from slipstream.services.cpu_kind import NATIVE_BF16, detected_cpu_kind

BEFORE = MatmulSettings(precision="highest", cudnn_tf32=False, cudnn_benchmark=False)


@pytest.fixture(autouse=True)
def _known_settings():
    """Start every test from known settings and leave the process as it was."""
    saved = MatmulSettings.current()
    set_matmul_precision(**asdict(BEFORE))
    yield
    set_matmul_precision(**asdict(saved))


def settings_probe(fail: bool = False):
    seen: list[MatmulSettings] = []

    def batch_start(state):
        seen.append(MatmulSettings.current())
        if fail:
            raise RuntimeError("probe failure")

    return Probe(batch_start=batch_start), seen


def fit(tmp_path, algos):
    return train(tmp_path, algos, max_duration="2ba", eval_interval=None, checkpoint_interval=None)


def test_settings_apply_during_the_run_and_are_restored(tmp_path):
    probe, seen = settings_probe()
    plugin = MatmulPrecision(MatmulPrecisionConfig(precision="medium"))
    trainer = fit(tmp_path, [plugin, probe])
    during = MatmulSettings(precision="medium", cudnn_tf32=True, cudnn_benchmark=True)
    assert seen == [during, during]
    assert MatmulSettings.current() == BEFORE
    assert trainer.summary["matmul_precision"] == "medium"


def test_default_is_high(tmp_path):
    probe, seen = settings_probe()
    fit(tmp_path, [MatmulPrecision(), probe])
    assert seen[0] == MatmulSettings(precision="high", cudnn_tf32=True, cudnn_benchmark=True)
    assert torch.backends.cuda.matmul.allow_tf32 is False  # restored with "highest"
    assert MatmulSettings.current() == BEFORE


def test_each_switch_is_configurable(tmp_path):
    probe, seen = settings_probe()
    cfg = plugin_config(MatmulPrecision, {"precision": "high", "cudnn_tf32": False,
                                         "cudnn_benchmark": False})
    fit(tmp_path, [MatmulPrecision(cfg), probe])
    assert seen[0] == MatmulSettings(precision="high", cudnn_tf32=False, cudnn_benchmark=False)
    # "high" is what torch.backends.cuda.matmul.allow_tf32 reads as True.
    assert MatmulSettings.current() == BEFORE


def test_without_plugin_settings_untouched(tmp_path):
    probe, seen = settings_probe()
    fit(tmp_path, [probe])
    assert seen == [BEFORE, BEFORE]


def test_restored_after_a_failing_run(tmp_path):
    probe, seen = settings_probe(fail=True)
    with pytest.raises(RuntimeError, match="probe failure"):
        fit(tmp_path, [MatmulPrecision(MatmulPrecisionConfig(precision="medium")), probe])
    assert seen[0].precision == "medium"
    assert MatmulSettings.current() == BEFORE


def test_config_errors():
    with pytest.raises(ConfigError) as err:
        plugin_config(MatmulPrecision, {"precision": "low"})
    msg = str(err.value)
    assert "precision" in msg and "'low'" in msg
    assert all(p in msg for p in ("highest", "high", "medium"))
    with pytest.raises(ConfigError, match="cudnn_benchmark"):
        plugin_config(MatmulPrecision, {"cudnn_benchmark": "maybe"})
    with pytest.raises(ConfigError, match="unknown key 'tf32'"):
        plugin_config(MatmulPrecision, {"tf32": True})


def test_set_matmul_precision_function():
    previous = set_matmul_precision("medium", cudnn_tf32=True, cudnn_benchmark=True)
    assert previous == BEFORE
    assert torch.get_float32_matmul_precision() == "medium"
    assert torch.backends.cuda.matmul.allow_tf32 is True  # the same switch as "high"/"medium"
    assert torch.backends.cudnn.benchmark is True
    set_matmul_precision(**asdict(previous))
    assert MatmulSettings.current() == BEFORE
    with pytest.raises(ValueError, match="precision must be one of highest, high, medium"):
        set_matmul_precision("fast")


@pytest.mark.bf16_hardware
def test_medium_changes_cpu_matmul_numerics():
    """What the plugin does on CPU: "medium" lets oneDNN compute fp32 matmuls in bf16
    (on CPUs with bf16 support), so results move off the exact fp32 ones."""
    if detected_cpu_kind() not in NATIVE_BF16:  # the real CPU's: numerics cannot be faked
        pytest.skip(f"needs a CPU with bf16 units, where oneDNN may compute fp32 matmuls in bf16; "
                    f"this one is {detected_cpu_kind()}")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 512, generator=g), torch.randn(512, 256, generator=g)
    exact = a.double() @ b.double()
    set_matmul_precision("highest")
    err_highest = (a @ b - exact).abs().max().item()
    set_matmul_precision("medium")
    err_medium = (a @ b - exact).abs().max().item()
    assert err_medium > err_highest


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU on this machine)")
def test_tf32_on_cuda():
    previous = set_matmul_precision("high")
    try:
        assert torch.backends.cuda.matmul.allow_tf32 is True
        assert torch.backends.cudnn.allow_tf32 is True
    finally:
        set_matmul_precision(**asdict(previous))
