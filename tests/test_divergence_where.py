"""A diverged run says where it went non-finite: the first parameters, the step, the
compute dtype, memory format and input size, and a hint that follows from them."""

from __future__ import annotations

import torch

from helpers import Probe, tiny_model, train
from slipstream import State
from slipstream.duration import Duration
from slipstream.services import nonfinite
from slipstream.services.nonfinite import locate


def poison_from(step: int, **at_init) -> Probe:
    """A NaN loss from ``step`` on (backward then fills the weights with NaN); at
    init, sets ``state`` attributes as a precision or memory-format plugin would."""

    def init(state):
        for name, value in at_init.items():
            setattr(state, name, value)

    def after_loss(state):
        if state.timestamp.batch + 1 >= step:
            state.loss = state.loss * float("nan")

    return Probe(init=init, after_loss=after_loss)


def parameter_names() -> list[str]:
    return [n for n, _ in tiny_model().named_parameters()]


def test_a_nan_from_the_loss_names_the_parameters_from_the_output_back_and_the_learning_rate(tmp_path):
    trainer = train(tmp_path, [poison_from(3)], max_duration="1ep", log_interval=1, checkpoint_interval=None)
    summary, names = trainer.summary, parameter_names()
    assert summary["status"] == "diverged"
    where = summary["nonfinite_at"]
    # The output layer's parameters first: backward spreads a NaN loss from there.
    assert where["parameters"][:2] == [names[-1], names[-2]] and where["found_in"] == "weight"
    assert where["step"] == 3 and summary["nonfinite_loss"]["first_step"] == 3
    assert (where["compute_dtype"], where["memory_format"], where["input_size"]) == (
        "float32", "NCHW (contiguous)", [16, 16]
    )
    assert "suspect" not in where
    reason = summary["stop_reason"]
    assert names[-1] in reason and "float32, NCHW (contiguous), input 16x16" in reason
    assert "lower optimizer.lr" in reason


def test_bf16_channels_last_with_a_1x1_map_points_at_the_onednn_fault(tmp_path, monkeypatch):
    # The fault needs an AMX CPU: its probe is simulated to reproduce (the probe itself
    # runs in test_onednn_bf16_conv.py).
    probed = []

    def reproduces(conv, shape, calls=nonfinite.PROBE_CALLS):
        probed.append((conv.kernel_size, tuple(shape)))
        return 2

    monkeypatch.setattr(nonfinite, "probe_conv_fault", reproduces)
    at_init = {"compute_dtype": torch.bfloat16, "input_memory_format": torch.channels_last}
    # At 16 px the ImageNet-stem test_resnet's last stage sees 1x1 maps.
    trainer = train(tmp_path, [poison_from(2, **at_init)], max_duration="1ep", log_interval=1,
                    checkpoint_interval=None)
    where = trainer.summary["nonfinite_at"]
    assert (where["compute_dtype"], where["memory_format"]) == ("bfloat16", "channels-last (NHWC)")
    suspect = where["suspect"]
    model = dict(tiny_model().named_modules())
    conv = model[suspect["module"]]
    assert isinstance(conv, torch.nn.Conv2d) and conv.kernel_size == (3, 3)  # wider kernels first
    assert suspect["input"][0] == 16 and suspect["input"][2:] == [1, 1]  # the run's batch, 1x1
    assert probed == [((3, 3), tuple(suspect["input"]))] and suspect["probe_nonfinite"] == 2
    reason = trainer.summary["stop_reason"]
    assert f"{suspect['module']} sees a 1x1 input in bf16 channels-last" in reason
    assert "oneDNN" in reason and "fp32" in reason and "NCHW" in reason and "data.image_size" in reason
    assert "lower optimizer.lr" not in reason  # the cause is known, and it is not the LR

    # Where the fault does not reproduce, it is named as possible, and the LR still is.
    monkeypatch.setattr(nonfinite, "probe_conv_fault", lambda conv, shape, calls=5: 0)
    state = trainer.state
    state.stop_status = None
    found = locate(state)
    assert "did not reproduce in 5 calls here" in found["hint"] and "lower optimizer.lr" in found["hint"]


def test_a_gradient_non_finite_inside_the_network_names_the_deepest_one():
    model = tiny_model()
    state = State(model, torch.optim.SGD(model.parameters(), lr=0.1), Duration.parse("1ep"))
    state.batch = (torch.zeros(8, 3, 16, 16), torch.zeros(8, dtype=torch.long))
    params = list(model.named_parameters())
    cut = next(i for i, (n, _) in enumerate(params) if n.startswith("layer3"))
    for i, (_, p) in enumerate(params):
        # Non-finite from a layer back to the input; the layers after it are finite.
        p.grad = torch.full_like(p, float("nan") if i < cut else 0.0)
    found = locate(state)
    origin = params[cut - 1][0]
    assert found["found_in"] == "gradient" and found["parameters"][0] == origin == found["origin"]
    assert found["nonfinite_parameters"] == cut and found["total_parameters"] == len(params)
    assert f"the first non-finite gradient is {origin}" in found["message"]
    assert found["hint"].startswith(f"look at {origin}")
