"""On a GPU: fp16 with a GradScaler (loss scaled, an inf gradient's step skipped and
counted, plain and fused optimizers), bf16 autocast, channels-last on cuDNN."""

from __future__ import annotations

import math

import pytest
import torch
from cuda_common import CUDA, fit_cuda, small_model
from slipstream_channels_last import ChannelsLast, ChannelsLastConfig
from slipstream_mixed_precision import MixedPrecision, MixedPrecisionConfig

from helpers import Probe

pytestmark = CUDA


def _params(state) -> list[torch.Tensor]:
    return [p for p in state.unwrapped_model.parameters() if p.grad is not None]


def _fp16_run(tmp_path, optimizer_kind: str, poisoned_batch: int) -> dict:
    """Four fp16 steps; at ``poisoned_batch`` one gradient element is set to inf after
    backward. Returns what a probe saw at each batch."""
    mp = MixedPrecision(MixedPrecisionConfig(dtype="fp16"))
    seen: dict = {"out": set(), "scale": {}, "scaled": {}, "unscaled": {}, "before": {}, "after": {}, "skipped": {}}

    def after_forward(state):
        seen["out"].add(state.outputs.dtype)

    def after_backward(state):
        b = state.timestamp.batch
        seen["scale"][b] = mp.scaler.get_scale()
        grads = [p.grad for p in _params(state)]
        seen["scaled"][b] = [g.detach().clone() for g in grads]
        if b == poisoned_batch:
            grads[0].view(-1)[0] = math.inf

    def before_optimizer_step(state):  # after the plugin's tryfirst unscale_
        b = state.timestamp.batch
        seen["unscaled"][b] = [p.grad.detach().clone() for p in _params(state)]
        seen["before"][b] = [p.detach().clone() for p in state.unwrapped_model.parameters()]

    def after_optimizer_step(state):
        b = state.timestamp.batch
        seen["after"][b] = [p.detach().clone() for p in state.unwrapped_model.parameters()]
        seen["skipped"][b] = state.step_skipped

    model = small_model()
    if optimizer_kind == "fused":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    probe = Probe(
        after_forward=after_forward,
        after_backward=after_backward,
        before_optimizer_step=before_optimizer_step,
        after_optimizer_step=after_optimizer_step,
    )
    trainer = fit_cuda(tmp_path, [mp, probe], model=model.cuda(), optimizer=optimizer, max_duration="4ba")
    seen["summary"] = trainer.summary
    return seen


@pytest.mark.parametrize("optimizer_kind", ["plain", "fused"])
def test_fp16_scales_the_loss_and_skips_and_counts_an_inf_step(tmp_path, optimizer_kind):
    poisoned = 2
    seen = _fp16_run(tmp_path, optimizer_kind, poisoned)
    assert seen["out"] == {torch.float16}
    assert seen["scale"][0] == 2.0**16  # GradScaler's initial scale
    # The loss was scaled: backward's gradients are the true ones times the scale.
    finite = [b for b, skipped in seen["skipped"].items() if not skipped]
    assert finite, seen["skipped"]
    b = finite[0]
    for scaled, true in zip(seen["scaled"][b], seen["unscaled"][b], strict=True):
        torch.testing.assert_close(true * seen["scale"][b], scaled, rtol=1e-6, atol=0)
    # The poisoned step is skipped (weights untouched) and counted; the scale halves.
    assert seen["skipped"][poisoned] is True
    for before, after in zip(seen["before"][poisoned], seen["after"][poisoned], strict=True):
        assert torch.equal(before, after)
    for b in finite:
        assert any(not torch.equal(x, y) for x, y in zip(seen["before"][b], seen["after"][b], strict=True))
    skipped = sum(seen["skipped"].values())
    assert seen["summary"]["skipped_steps"] == skipped >= 1
    assert seen["summary"]["loss_scale"] == 2.0**16 * 0.5**skipped


def test_bf16_autocast_outputs_bf16_and_keeps_fp32_weights(tmp_path):
    seen: dict = {}

    def after_forward(state):
        seen["outputs"] = state.outputs.dtype

    def after_loss(state):
        seen["loss"] = state.loss.dtype

    def before_optimizer_step(state):
        seen["weights"] = {p.dtype for p in state.unwrapped_model.parameters()}
        seen["grads"] = {p.grad.dtype for p in _params(state)}

    probe = Probe(after_forward=after_forward, after_loss=after_loss, before_optimizer_step=before_optimizer_step)
    trainer = fit_cuda(tmp_path, [MixedPrecision(MixedPrecisionConfig(dtype="bf16")), probe])
    assert seen == {
        "outputs": torch.bfloat16,
        "loss": torch.float32,
        "weights": {torch.float32},
        "grads": {torch.float32},
    }
    assert trainer.summary["autocast_dtype"] == "bf16" and trainer.summary["compute_dtype"] == "bf16"
    assert "skipped_steps" not in trainer.summary  # no GradScaler in bf16


def test_channels_last_weights_and_inputs_on_cudnn(tmp_path):
    assert torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled
    seen: dict = {"conv_out": []}

    def before_forward(state):
        x = state.batch[0]
        seen["input"] = (x.device.type, x.dtype, x.is_contiguous(memory_format=torch.channels_last))
        seen["weights"] = {
            m.weight.is_contiguous(memory_format=torch.channels_last)
            for m in state.unwrapped_model.modules()
            if isinstance(m, torch.nn.Conv2d)
        }

    model = small_model()
    first_conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    first_conv.register_forward_hook(
        lambda _m, _i, out: seen["conv_out"].append(out.is_contiguous(memory_format=torch.channels_last))
    )
    always = ChannelsLast(ChannelsLastConfig(mode="always"))  # not measured: the probe must see NHWC
    fit_cuda(tmp_path, [always, Probe(before_forward=before_forward)], model=model, max_duration="2ba")
    assert seen["input"] == ("cuda", torch.float32, True)
    assert seen["weights"] == {True}
    # cuDNN kept the layout: the first convolution's output is channels-last too.
    assert seen["conv_out"] and all(seen["conv_out"])
