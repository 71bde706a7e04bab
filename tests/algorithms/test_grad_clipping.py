"""grad_clipping: clip by total norm or by value at before_optimizer_step."""

from __future__ import annotations

import json
import warnings
from collections import OrderedDict

import pytest
import torch
from slipstream_grad_clipping import GradClipping, GradClippingConfig, clip_gradients

from helpers import Probe, train
from slipstream import ConfigError
from slipstream.plugins.discovery import discover, plugin_config


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(OrderedDict(
        conv=torch.nn.Conv2d(3, 8, 3, stride=2, padding=1),
        bn=torch.nn.BatchNorm2d(8),
        act=torch.nn.ReLU(),
        pool=torch.nn.AdaptiveAvgPool2d(2),
        flat=torch.nn.Flatten(),
        fc=torch.nn.Linear(32, 4),
    ))


def clip(**kwargs) -> GradClipping:
    return GradClipping(GradClippingConfig(**kwargs))


def grads(state) -> list[torch.Tensor]:
    return [p.grad for p in state.model.parameters() if p.grad is not None]


class AfterClipping(Probe):
    """Sees the gradients the optimizer will step with."""

    runs_after = ("grad_clipping",)


class Injector(Probe):
    name = "injector"


def run(tmp_path, algos, **kwargs):
    """Train, recording the total grad norm, max |grad| and the logged grad_norm
    that a probe after grad_clipping sees at every step."""
    seen: list[dict] = []

    def record(state):
        g = grads(state)
        logged = state.metrics.get("grad_norm")
        seen.append({
            "norm": torch.nn.utils.get_total_norm(g).item(),
            "max": max(t.abs().max().item() for t in g),
            "logged": None if logged is None else logged.item(),
            "logged_is_tensor": isinstance(logged, torch.Tensor),
        })

    probe = AfterClipping(before_optimizer_step=record)
    kwargs.setdefault("model", small_model())
    trainer = train(tmp_path, [probe, *algos], max_duration="1ep", eval_interval=None,
                    checkpoint_interval=None, lr=0.05, **kwargs)
    return trainer, seen


def test_max_norm_bounds_the_total_norm(tmp_path):
    trainer, seen = run(tmp_path, [clip(max_norm=1e-3)], log_interval=1)
    assert [a.name for a in trainer.algorithms] == ["grad_clipping", "probe"]
    for s in seen:
        assert s["norm"] <= 1e-3 * (1 + 1e-4)
        # The logged norm is the pre-clip one, a device tensor (no per-step sync).
        assert s["logged_is_tensor"] and s["logged"] > 1e-3
        assert s["norm"] == pytest.approx(1e-3, rel=1e-3)  # scaled down to exactly max_norm
    logged = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").open()]
    assert [r["grad_norm"] for r in logged if r["kind"] == "train"] == pytest.approx(
        [s["logged"] for s in seen]
    )


def test_without_plugin_gradients_are_larger(tmp_path):
    trainer, seen = run(tmp_path, [])
    assert all(s["norm"] > 1e-2 for s in seen)
    assert all(s["logged"] is None for s in seen)


def test_clip_value_bounds_every_element(tmp_path):
    _, unclipped = run(tmp_path / "a", [])
    assert max(s["max"] for s in unclipped) > 1e-3
    _, seen = run(tmp_path / "b", [clip(clip_value=1e-3)])
    bound = torch.tensor(1e-3).item()  # 1e-3 rounded to float32, as the gradients are
    assert all(s["max"] <= bound for s in seen)
    assert any(s["max"] == bound for s in seen)
    assert all(s["logged"] > 1e-3 for s in seen)  # pre-clip norm logged by default


def test_order_with_mixed_precision_bf16(tmp_path):
    mp_cls = discover()["mixed_precision"].cls
    if mp_cls is None:
        pytest.skip("slipstream-mixed_precision is not installed")
    # Explicit bf16: auto trains in fp32 on a CPU without bf16 units.
    trainer, seen = run(tmp_path, [clip(max_norm=1e-3), mp_cls(plugin_config(mp_cls, {"dtype": "bf16"}))])
    assert [a.name for a in trainer.algorithms] == ["mixed_precision", "grad_clipping", "probe"]
    assert trainer.state.compute_dtype == torch.bfloat16
    assert all(s["norm"] <= 1e-3 * (1 + 1e-4) for s in seen)


def test_fp16_clips_true_gradients_and_survives_overflow(tmp_path):
    """Under fp16 the GradScaler unscales first: clipping acts on true gradients
    (post-clip norm is max_norm, not max_norm / scale) and logs the true norm; an
    overflowing step neither crashes nor moves the weights."""
    mp_cls = discover()["mixed_precision"].cls
    if mp_cls is None:
        pytest.skip("slipstream-mixed_precision is not installed")
    mp = mp_cls(plugin_config(mp_cls, {"dtype": "fp16"}))
    scaled: list[float] = []

    def after_backward(state):
        scaled.append(torch.nn.utils.get_total_norm(grads(state)).item() / mp.scaler.get_scale())
        if state.timestamp.batch == 1:
            state.model.fc.weight.grad[0, 0] = float("inf")

    skipped: list[bool] = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="mixed_precision: fp16 on CPU")
        trainer, seen = run(
            tmp_path,
            [clip(max_norm=1e-3), mp, Injector(after_backward=after_backward,
                                               after_optimizer_step=lambda s: skipped.append(
                                                   s.step_skipped))],
        )
    assert skipped == [False, True, False, False]
    for s, true_norm, was_skipped in zip(seen, scaled, skipped, strict=True):
        if was_skipped:
            assert s["logged"] != s["logged"] or s["logged"] == float("inf")  # NaN or inf
            continue
        assert s["logged"] == pytest.approx(true_norm, rel=1e-3)
        assert s["norm"] == pytest.approx(1e-3, rel=1e-3)
    assert trainer.summary["skipped_steps"] == 1
    assert all(torch.isfinite(p).all() for p in trainer.state.model.parameters())


def test_config_errors():
    with pytest.raises(ConfigError, match="exactly one of max_norm .* or clip_value"):
        plugin_config(GradClipping, {})
    with pytest.raises(ConfigError, match="exactly one of max_norm"):
        plugin_config(GradClipping, {"max_norm": 1.0, "clip_value": 0.5})
    with pytest.raises(ConfigError, match="max_norm must be a finite number > 0, got -1.0"):
        plugin_config(GradClipping, {"max_norm": -1.0})
    with pytest.raises(ConfigError, match="clip_value must be a finite number > 0"):
        plugin_config(GradClipping, {"clip_value": 0.0})
    with pytest.raises(ConfigError, match="norm_type must be a number > 0"):
        plugin_config(GradClipping, {"max_norm": 1.0, "norm_type": 0.0})
    with pytest.raises(ConfigError, match="max_norm"):
        plugin_config(GradClipping, {"max_norm": "big"})
    cfg = plugin_config(GradClipping, {"max_norm": 1})
    assert (cfg.max_norm, cfg.clip_value, cfg.norm_type) == (1.0, None, 2.0)


def test_clip_gradients_function():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    a.grad, b.grad = torch.full((3,), 4.0), torch.full((4,), -3.0)
    unused = torch.nn.Parameter(torch.zeros(2))  # no grad: ignored
    before = torch.cat([a.grad, b.grad]).norm()
    norm = clip_gradients([a, b, unused], max_norm=1.0)
    assert norm == pytest.approx(before.item())
    assert torch.cat([a.grad, b.grad]).norm().item() == pytest.approx(1.0, rel=1e-4)
    # Below max_norm nothing changes.
    a.grad = torch.full((3,), 0.1)
    b.grad = torch.zeros(4)
    clip_gradients([a, b], max_norm=1.0)
    assert torch.equal(a.grad, torch.full((3,), 0.1))
    # By value: elementwise clamp, returns the pre-clip norm unless asked not to.
    a.grad = torch.tensor([5.0, -0.2, -7.0])
    norm = clip_gradients([a], clip_value=0.5)
    assert norm == pytest.approx(torch.tensor([5.0, -0.2, -7.0]).norm().item())
    assert torch.equal(a.grad, torch.tensor([0.5, -0.2, -0.5]))
    assert clip_gradients([a], clip_value=0.5, return_norm=False) is None
    # inf norm.
    a.grad = torch.tensor([3.0, -4.0, 1.0])
    assert clip_gradients([a], max_norm=2.0, norm_type=float("inf")) == 4.0
    assert a.grad.abs().max().item() == pytest.approx(2.0, rel=1e-4)
    # Non-finite gradients do not raise.
    a.grad = torch.tensor([float("inf"), 1.0, 0.0])
    assert not torch.isfinite(clip_gradients([a], max_norm=1.0))
    with pytest.raises(ValueError, match="exactly one"):
        clip_gradients([a])
