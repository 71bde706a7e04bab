"""label_smoothing: the training loss is torch's label-smoothed cross-entropy, the
evaluation loss stays plain, and the wrapper composes with other loss plugins."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from slipstream_label_smoothing import LabelSmoothing, LabelSmoothingConfig, smooth_cross_entropy

from helpers import Probe, tiny_loaders
from helpers import train as _train
from slipstream import Algorithm, ConfigError, hookimpl
from slipstream.plugins.discovery import PluginInfo, discover, plugin_config

# Naming every algorithm of a run (probes included) in `installed` spares the engine
# a scan of all installed distributions at each summary/checkpoint write.
INSTALLED = discover()


def train(tmp_path, algos, **kwargs):
    known = {a.name: PluginInfo(a.name, "tests", "0", "helpers", cls=type(a)) for a in algos}
    kwargs.setdefault("checkpoint_interval", None)
    return _train(tmp_path, algos, installed={**known, **INSTALLED}, **kwargs)


def smoothing(s: float) -> LabelSmoothing:
    return LabelSmoothing(plugin_config(LabelSmoothing, {"smoothing": s}))


def loss_recorder():
    """Records (loss the loop uses, smoothed CE, plain CE) recomputed from the same outputs."""
    seen: list[tuple[torch.Tensor, ...]] = []

    def record(state):
        logits, targets = state.outputs.detach().float(), state.batch[1]
        seen.append(
            (
                state.loss.detach(),
                smooth_cross_entropy(logits, targets, 0.1),
                F.cross_entropy(logits, targets),
            )
        )
        assert (
            isinstance(state.loss_fn, torch.nn.CrossEntropyLoss)
            and state.loss_fn.label_smoothing == 0
        )

    return Probe(after_loss=record), seen


# -- the pure function -------------------------------------------------------------


@pytest.mark.parametrize("s", [0.0, 0.1, 0.35])
def test_smooth_cross_entropy_equals_torch_and_the_formula(s):
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(32, 10, generator=g), torch.randint(0, 10, (32,), generator=g)
    ours = smooth_cross_entropy(logits, targets, s)
    torch.testing.assert_close(ours, torch.nn.CrossEntropyLoss(label_smoothing=s)(logits, targets))
    # Target (1 - s) * one_hot + s / K, written out.
    soft = (1 - s) * F.one_hot(targets, 10) + s / 10
    torch.testing.assert_close(ours, -(soft * logits.log_softmax(1)).sum(1).mean())
    assert (ours == F.cross_entropy(logits, targets)) == (s == 0)


def test_smooth_cross_entropy_refuses_a_smoothing_outside_0_1():
    with pytest.raises(ValueError, match=r"smoothing must be a finite number in \[0, 1\)"):
        smooth_cross_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), 1.0)


# -- in training ---------------------------------------------------------------------


def test_training_loss_is_smoothed_and_off_is_plain(tmp_path):
    probe, on = loss_recorder()
    train(tmp_path / "on", [smoothing(0.1), probe], max_duration="3ba")
    for loss, smoothed, plain in on:
        torch.testing.assert_close(loss, smoothed)
        assert not torch.allclose(loss, plain)

    probe, off = loss_recorder()
    train(tmp_path / "off", [probe], max_duration="3ba")
    for loss, _, plain in off:
        torch.testing.assert_close(loss, plain)


def test_evaluation_loss_stays_plain_cross_entropy(tmp_path):
    sums = []
    probe = Probe(
        eval_start=lambda s: sums.append(0.0),
        eval_batch_end=lambda s: sums.__setitem__(
            -1, sums[-1] + F.cross_entropy(s.outputs, s.batch[1], reduction="sum").item()
        ),
    )
    trainer = train(tmp_path, [smoothing(0.3), probe], max_duration="1ep")
    n = len(tiny_loaders()[1].dataset)
    assert trainer.state.eval_metrics["loss"] == pytest.approx(sums[-1] / n, rel=1e-5)


class ReplacesLoss(Algorithm):
    """A plugin that replaces compute_loss (as distillation or mixup would) using state.loss_fn."""

    name = "replaces_loss"

    @hookimpl
    def compute_loss(self, state):
        return 2.0 * state.loss_fn(state.outputs, state.batch[1])


class AutocastAndHalve(Algorithm):
    """Wraps both steps as mixed precision and gradient accumulation do."""

    name = "autocast_and_halve"

    @hookimpl(wrapper=True)
    def forward(self, state):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (yield)

    @hookimpl(wrapper=True)
    def compute_loss(self, state):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = yield
        return loss / 2


@pytest.mark.parametrize("other, factor", [(ReplacesLoss, 2.0), (AutocastAndHalve, 0.5)])
@pytest.mark.parametrize("first", [True, False], ids=["smoothing-outer", "smoothing-inner"])
def test_composes_with_a_replaced_or_wrapped_compute_loss(tmp_path, other, factor, first):
    probe, seen = loss_recorder()
    algos = [smoothing(0.1), other()] if first else [other(), smoothing(0.1)]
    train(tmp_path, [*algos, probe], max_duration="2ba")
    for loss, smoothed, _ in seen:
        torch.testing.assert_close(loss.float(), factor * smoothed)


def test_keeps_class_weights_and_refuses_a_loss_it_cannot_smooth(tmp_path):
    weight = torch.tensor([1.0, 2.0, 3.0, 4.0])
    seen = []
    probe = Probe(
        after_loss=lambda s: seen.append(
            (
                s.loss.detach(),
                F.cross_entropy(s.outputs.detach(), s.batch[1], weight=weight, label_smoothing=0.2),
            )
        )
    )
    train(
        tmp_path / "w",
        [smoothing(0.2), probe],
        max_duration="2ba",
        loss_fn=torch.nn.CrossEntropyLoss(weight=weight),
    )
    for loss, expected in seen:
        torch.testing.assert_close(loss, expected)

    with pytest.raises(ConfigError, match="nn.CrossEntropyLoss"):
        train(
            tmp_path / "mse",
            [smoothing(0.1)],
            max_duration="2ba",
            loss_fn=lambda out, y: out.pow(2).mean(),
        )
    with pytest.raises(ConfigError, match="already smooths labels"):
        train(
            tmp_path / "twice",
            [smoothing(0.1)],
            max_duration="2ba",
            loss_fn=torch.nn.CrossEntropyLoss(label_smoothing=0.1),
        )


# -- config and discovery ------------------------------------------------------------


@pytest.mark.parametrize("value", [1.5, 1.0, -0.1])
def test_smoothing_out_of_range_is_a_config_error(value):
    with pytest.raises(
        ConfigError, match=r"algorithms.label_smoothing: smoothing must be a finite number in \[0, 1\)"
    ):
        plugin_config(LabelSmoothing, {"smoothing": value})


def test_defaults():
    assert LabelSmoothing().config == LabelSmoothingConfig(smoothing=0.1)
    assert plugin_config(LabelSmoothing, {}).smoothing == 0.1


def test_multi_hot_targets_are_smoothed_per_class_through_bce(tmp_path):
    """A multi-label run (multi-hot float targets, loss.name=bce): each class's binary
    target becomes (1 - s) * y + s / K; without the plugin the loss is plain BCE."""
    from slipstream.models import build_loss

    x = torch.cat([x for x, _ in tiny_loaders()[0]])
    multi_hot = (torch.arange(64).unsqueeze(1) // torch.tensor([1, 2, 3, 5]) % 2).float()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, multi_hot), batch_size=16)
    for name, algos, s in (("on", [smoothing(0.2)], 0.2), ("off", [], 0.0)):
        seen: list[tuple[torch.Tensor, ...]] = []
        record = lambda st, seen=seen: seen.append((st.loss.detach(), st.outputs.detach(), st.batch[1]))  # noqa: E731
        probe = Probe(after_loss=record)
        train(tmp_path / name, [*algos, probe], train_data=data, loss_fn=build_loss("bce"), max_duration="1ba",
              eval_interval=None)  # fmt: skip
        assert len(seen) == 1
        for loss, out, y in seen:
            assert torch.equal(y.unique(), torch.tensor([0.0, 1.0]))
            expected = F.binary_cross_entropy_with_logits(out, (1 - s) * y + s / 4)
            torch.testing.assert_close(loss, expected)
            assert (loss == F.binary_cross_entropy_with_logits(out, y)) == (s == 0)
