"""channels_last: model and batches in NHWC, still after other batch transforms."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from slipstream_channels_last import (
    ChannelsLast,
    ChannelsLastConfig,
    apply_channels_last,
    batch_to_channels_last,
    conv2d_layers,
    to_channels_last,
)

from helpers import Probe, tiny_loaders, tiny_model, train
from slipstream import Algorithm, ConfigError, Trainer, hookimpl
from slipstream.plugins.discovery import plugin_config

CL = torch.channels_last
# Always NHWC: these tests are about what the conversion does, not whether auto picks it.
ON = ChannelsLastConfig(mode="always")


def _spatial_conv_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    # 1x1 kernels are both NCHW- and NHWC-contiguous; only k > 1 tells them apart.
    return [c.weight for c in conv2d_layers(model) if c.weight.shape[-1] > 1]


class Record(Probe):
    """Records the layout of the model and of the inputs the model is given."""

    def __init__(self, **callbacks) -> None:
        super().__init__(
            before_forward=self._train, eval_batch_end=self._eval, **callbacks
        )
        self.weights_cl: list[bool] = []
        self.weights_nchw: list[bool] = []
        self.inputs_cl: list[bool] = []
        self.input_sizes: list[int] = []
        self.eval_inputs_cl: list[bool] = []

    def _train(self, state) -> None:
        weights = _spatial_conv_weights(state.unwrapped_model)
        self.weights_cl.append(all(w.is_contiguous(memory_format=CL) for w in weights))
        self.weights_nchw.append(all(w.is_contiguous() for w in weights))
        inputs = state.batch[0]
        self.inputs_cl.append(inputs.is_contiguous(memory_format=CL) and not inputs.is_contiguous())
        self.input_sizes.append(inputs.shape[-1])

    def _eval(self, state) -> None:
        self.eval_inputs_cl.append(state.batch[0].is_contiguous(memory_format=CL))


def _resize_to_24(state) -> None:
    # .contiguous(): a transform returns NCHW whatever it was given (interpolate
    # alone would keep a channels-last input channels-last and prove nothing).
    inputs, targets = state.batch
    resized = F.interpolate(inputs, size=24, mode="bilinear", align_corners=False)
    state.batch = (resized.contiguous(), targets)


class ResizeEarlier(Probe):
    name = "image_size_curriculum"  # earlier in the order: a name channels_last knows


class ResizeLater(Probe):
    name = "late_resize"
    runs_after = ("channels_last",)  # fires after channels_last at batch_start


class ResizeLast(Algorithm):
    name = "trylast_resize"

    @hookimpl(trylast=True)
    def batch_start(self, state):
        _resize_to_24(state)


def test_model_and_inputs_channels_last_when_on(tmp_path):
    record = Record()
    normalize = ((0.5,) * 3, (0.25,) * 3)
    train(tmp_path, [ChannelsLast(ON), record], max_duration="3ba", normalize=normalize)
    assert record.weights_cl and all(record.weights_cl)
    assert not any(record.weights_nchw)
    assert all(record.inputs_cl)  # also after the engine's normalisation
    assert record.eval_inputs_cl and all(record.eval_inputs_cl)


def test_nothing_changes_when_off(tmp_path):
    record = Record()
    train(tmp_path, [record], max_duration="3ba")
    assert all(record.weights_nchw) and not any(record.weights_cl)
    assert not any(record.inputs_cl)
    assert record.eval_inputs_cl and not any(record.eval_inputs_cl)


@pytest.mark.parametrize(
    "resize",
    [
        lambda: ResizeEarlier(batch_start=_resize_to_24),
        lambda: ResizeLater(batch_start=_resize_to_24),
        ResizeLast,
    ],
    ids=["earlier", "later", "trylast"],
)
def test_channels_last_after_a_resize_anywhere_in_the_order(tmp_path, resize):
    # The engine writes the batch in the model's format after every batch_start
    # implementation, so where a transform sits does not matter.
    record = Record()
    train(tmp_path, [ChannelsLast(ON), resize(), record], max_duration="2ba")
    assert record.input_sizes == [24, 24]
    assert all(record.inputs_cl)


def test_the_plugin_sets_the_input_memory_format_and_converts_no_batch(tmp_path):
    formats = []
    probe = Probe(fit_start=lambda s: formats.append(s.input_memory_format))
    seen_at_batch_start = []
    probe.callbacks["batch_start"] = lambda s: seen_at_batch_start.append(
        s.batch[0].is_contiguous()
    )
    train(tmp_path, [ChannelsLast(ON), probe], max_duration="2ba", eval_interval=None)
    assert formats == [CL]
    assert all(seen_at_batch_start)  # NCHW as collated: the engine converts later


def test_vit_warns_and_trains(tmp_path):
    record = Record()
    with pytest.warns(UserWarning, match="patch embeddings"):
        vit = tiny_model("vit")
        trainer = train(tmp_path, [ChannelsLast(ON), record], model=vit, max_duration="2ba")
    assert trainer.summary["batches"] == 2 and trainer.summary["accuracy"] is not None


def test_model_without_conv_warns_and_is_left_alone(tmp_path):
    record = Record()
    mlp = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 4))
    with pytest.warns(UserWarning, match="no 2-D convolution"):
        trainer = train(tmp_path, [ChannelsLast(ON), record], model=mlp, max_duration="2ba")
    assert trainer.summary["batches"] == 2
    assert not any(record.inputs_cl)  # no pointless copy of every batch


def test_warning_can_be_turned_off(tmp_path):
    mlp = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 4))
    cfg = plugin_config(ChannelsLast, {"warn_without_conv": False})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(tmp_path, [ChannelsLast(cfg)], model=mlp, max_duration="1ba")


def test_config_type_error_names_the_key():
    with pytest.raises(ConfigError, match="warn_without_conv"):
        plugin_config(ChannelsLast, {"warn_without_conv": "sometimes"})
    with pytest.raises(ConfigError, match="allowed keys: warn_without_conv"):
        plugin_config(ChannelsLast, {"warn": True})
    assert plugin_config(ChannelsLast, {}) == ChannelsLastConfig()


def test_checkpoint_resumes_and_loads_into_a_plain_model(tmp_path):
    first = train(tmp_path, [ChannelsLast(ON)], max_duration="4ba")
    latest = first.run_dir / "checkpoints" / "latest.pt"
    record = Record()
    model = tiny_model()
    train_data, eval_data = tiny_loaders()
    resumed = Trainer(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        train_data=train_data,
        eval_data=eval_data,
        max_duration="6ba",
        algorithms=[ChannelsLast(ON), record],
        run_dir=first.run_dir,
        device="cpu",
        load_path=latest,
        progress_bar=False,
        verbose=False,
    )
    resumed.fit()
    assert resumed.summary["batches"] == 6 and record.weights_cl == [True, True]
    # The saved weights are ordinary tensors: a model without the plugin loads them.
    plain = tiny_model()
    plain.load_state_dict(torch.load(latest, weights_only=True)["model"])
    trained = resumed.state.unwrapped_model
    x = torch.rand(2, 3, 16, 16)
    plain.eval(), trained.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(x), trained(x), rtol=1e-4, atol=1e-5)


def test_apply_channels_last_is_in_place_and_keeps_outputs():
    model = tiny_model().eval()
    params = list(model.parameters())
    x = torch.rand(2, 3, 16, 16)
    with torch.no_grad():
        before = model(x)
        assert apply_channels_last(model) is model
        after = model(to_channels_last(x))
    assert [p for p in model.parameters()] == params  # same Parameter objects
    assert all(w.is_contiguous(memory_format=CL) for w in _spatial_conv_weights(model))
    torch.testing.assert_close(before, after, rtol=1e-4, atol=1e-5)


def test_batch_functions():
    x, y = torch.rand(2, 3, 8, 8), torch.tensor([0, 1])
    converted = to_channels_last(x)
    assert converted.is_contiguous(memory_format=CL) and torch.equal(converted, x)
    assert to_channels_last(converted) is converted  # no second copy
    flat = torch.rand(2, 5)
    assert to_channels_last(flat) is flat
    inputs, targets = batch_to_channels_last((x, y))
    assert inputs.is_contiguous(memory_format=CL) and targets is y
    assert isinstance(batch_to_channels_last([x, y]), list)
    assert batch_to_channels_last(x).is_contiguous(memory_format=CL)
