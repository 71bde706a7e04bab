"""mixup: training batches become convex combinations of image pairs with soft targets
(the drawn lambda, rows summing to 1), reproducibly and bit-exactly across a resume;
evaluation is untouched; it composes with label_smoothing; bad config fails early."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from slipstream_label_smoothing import LabelSmoothing, LabelSmoothingConfig
from slipstream_mixup import Mixup, MixupConfig, draw_lambda, mix_targets, mixup_batch

from helpers import Probe, tiny_loaders
from helpers import train as _train
from slipstream import ConfigError
from slipstream.plugins.discovery import PluginInfo, discover, plugin_config

RAW_TRAIN, RAW_EVAL = (torch.cat([x for x, _ in loader]) for loader in tiny_loaders())
LABELS = torch.cat([y for _, y in tiny_loaders()[0]])
K = 4  # the tiny model's classes
INSTALLED = discover(load=False)  # metadata only: names for the order declarations


def train(tmp_path, algos, **kwargs):
    # Naming the run's algorithms spares the engine a scan of every installed distribution.
    known = {a.name: PluginInfo(a.name, "tests", "0", "helpers", cls=type(a)) for a in algos}
    return _train(tmp_path, algos, installed={**INSTALLED, **known}, **kwargs)


def mixup(**options) -> Mixup:
    return Mixup(plugin_config(Mixup, options))


def seen_batches(tmp_path, algos, **kwargs):
    """(inputs, targets, loss, logits) at each training batch, as the model and the loss saw them."""
    seen: list[list] = []
    probe = Probe(
        before_forward=lambda s: seen.append([s.batch[0].clone(), s.batch[1].clone()]),
        after_forward=lambda s: seen[-1].append(s.outputs.detach().clone()),
        after_loss=lambda s: seen[-1].insert(2, s.loss.detach().clone()),
    )
    trainer = train(tmp_path, [*algos, probe], **kwargs)
    return seen, trainer


# -- the pure functions --------------------------------------------------------------


def test_mixup_batch_is_the_convex_combination_with_the_drawn_lambda():
    x = torch.randint(0, 256, (6, 3, 8, 8), dtype=torch.uint8)
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    kept = x.clone()
    mixed, soft, lam = mixup_batch(x, y, K, alpha=0.4, generator=np.random.default_rng(7))
    assert lam == draw_lambda(0.4, np.random.default_rng(7)) and 0 < lam < 1
    unit = x.float() / 255
    assert torch.allclose(mixed, lam * unit + (1 - lam) * unit.roll(1, 0), atol=1e-6)
    assert mixed.dtype == torch.float32 and torch.equal(x, kept)
    assert torch.allclose(soft.sum(dim=1), torch.ones(6))
    expected = lam * F.one_hot(y, K).float() + (1 - lam) * F.one_hot(y.roll(1), K).float()
    assert torch.allclose(soft, expected)
    # Already-soft targets are mixed as probabilities.
    assert torch.allclose(mix_targets(soft, K, 1.0), soft)


def test_the_same_generator_seed_draws_the_same_mix():
    x, y = torch.rand(4, 3, 8, 8), torch.arange(4)
    a = mixup_batch(x, y, K, generator=np.random.default_rng(1))
    b = mixup_batch(x, y, K, generator=np.random.default_rng(1))
    c = mixup_batch(x, y, K, generator=np.random.default_rng(2))
    assert torch.equal(a[0], b[0]) and a[2] == b[2] and a[2] != c[2]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"alpha": 0}, "algorithms.mixup: alpha must be a finite number > 0"),
        ({"prob": 1.5}, "algorithms.mixup: prob must be a finite number in [0, 1]"),
        ({"num_classes": 1}, "algorithms.mixup: num_classes must be a whole number >= 2"),
        ({"alpah": 1}, "algorithms.mixup: unknown key 'alpah'"),
    ],
)
def test_bad_config_names_the_key(options, message):
    with pytest.raises(ConfigError) as info:
        plugin_config(Mixup, options)
    assert str(info.value).startswith(message)


# -- in training -----------------------------------------------------------------------


def test_training_batches_are_mixed_and_off_leaves_them_raw(tmp_path):
    raw = list(RAW_TRAIN.split(16))[:3]
    labels = list(LABELS.split(16))[:3]
    on, _ = seen_batches(tmp_path / "on", [mixup(alpha=1.0)], max_duration="3ba")
    for name, off in (
        ("absent", seen_batches(tmp_path / "absent", [], max_duration="3ba")[0]),
        ("prob 0", seen_batches(tmp_path / "p0", [mixup(prob=0.0)], max_duration="3ba")[0]),
    ):
        assert all(torch.equal(x, r) for (x, *_), r in zip(off, raw, strict=True)), name
        assert all(torch.equal(t, y) for (_, t, *_), y in zip(off, labels, strict=True)), name
    lams = []
    for (x, soft, *_), r, y in zip(on, raw, labels, strict=True):
        assert soft.shape == (16, K) and torch.allclose(soft.sum(dim=1), torch.ones(16))
        lam = soft[0, y[0]].item()  # neighbours are of different classes in this data
        assert torch.allclose(soft, mix_targets(y, K, lam))
        assert torch.allclose(x, lam * r + (1 - lam) * r.roll(1, 0), atol=1e-6)
        assert not torch.equal(x, r)
        lams.append(lam)
    assert len(set(lams)) == 3  # a new draw every batch


def test_evaluation_is_untouched(tmp_path):
    seen: dict[str, list] = {"start": [], "logits": [], "targets": []}

    def keep(state):
        seen["logits"].append(state.outputs.float())
        seen["targets"].append(state.batch[1])

    probe = Probe(eval_batch_start=lambda s: seen["start"].append(s.batch[0].clone()), eval_batch_end=keep)
    trainer = train(tmp_path, [mixup(), probe], max_duration="1ep")
    assert torch.equal(torch.cat(seen["start"]), RAW_EVAL)
    assert torch.cat(seen["targets"]).dtype == torch.long
    plain = F.cross_entropy(torch.cat(seen["logits"]), torch.cat(seen["targets"])).item()
    assert trainer.state.eval_metrics["loss"] == pytest.approx(plain, rel=1e-5)


def test_a_resumed_run_continues_bit_exactly(tmp_path):
    whole, straight = seen_batches(tmp_path / "whole", [mixup()], max_duration="6ba", checkpoint_interval=None)
    first = train(tmp_path / "half", [mixup()], max_duration="3ba", checkpoint_interval="3ba")
    latest = first.run_dir / "checkpoints" / "latest.pt"
    resumed, trainer = seen_batches(tmp_path / "half", [mixup()], max_duration="6ba", load_path=latest)
    assert len(resumed) == 3
    for a, b in zip(whole[3:], resumed, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    for p, q in zip(straight.state.model.parameters(), trainer.state.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_composes_with_label_smoothing_in_either_order(tmp_path):
    smoothing = 0.2
    losses = []
    for name, algos in (
        ("ls-first", [LabelSmoothing(LabelSmoothingConfig(smoothing)), mixup()]),
        ("mixup-first", [mixup(), LabelSmoothing(LabelSmoothingConfig(smoothing))]),
    ):
        seen, _ = seen_batches(tmp_path / name, algos, max_duration="2ba")
        for _, soft, loss, out in seen:
            target = (1 - smoothing) * soft + smoothing / K  # the mixed target, then smoothed
            expected = -(target * out.log_softmax(dim=1)).sum(dim=1).mean()
            assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
            assert loss.item() != pytest.approx(F.cross_entropy(out, soft).item(), rel=1e-4)
        losses.append([loss for _, _, loss, _ in seen])
    assert all(torch.equal(a, b) for a, b in zip(*losses, strict=True))


def test_a_loss_that_takes_no_probabilities_is_refused_before_the_first_batch(tmp_path):
    with pytest.raises(ConfigError, match=r"algorithms.mixup: the run's loss_fn \(NLLLoss\)"):
        train(tmp_path, [mixup()], max_duration="1ba", loss_fn=torch.nn.NLLLoss())


def test_num_classes_from_config_when_the_model_does_not_say(tmp_path):
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, K))
    seen, _ = seen_batches(tmp_path, [mixup(num_classes=K)], model=model, max_duration="1ba")
    assert seen[0][1].shape == (16, K)
    assert MixupConfig().num_classes is None


# -- multi-label targets -----------------------------------------------------------------

# Multi-hot targets of the tiny data: several classes per image, some rows sharing a class.
MULTI_HOT = (torch.arange(64).unsqueeze(1) // torch.tensor([1, 2, 3, 5]) % 2).float()


def multi_label_data():
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(RAW_TRAIN, MULTI_HOT), batch_size=16)


def test_multi_hot_targets_are_mixed_by_the_same_convex_combination():
    y, lam = MULTI_HOT[:8], 0.3
    mixed = mix_targets(y, K, lam)
    assert torch.allclose(mixed, lam * y + (1 - lam) * y.roll(1, 0))
    both = (y == 1) & (y.roll(1, 0) == 1)
    assert both.any() and torch.equal(mixed[both], torch.ones(int(both.sum())))  # shown in both images: 1
    assert not torch.allclose(mixed.sum(dim=1), torch.ones(8))  # rows are no probabilities
    with pytest.raises(ConfigError, match=r"or of 4 classes \(N, 4\), got shape \(8, 5\)"):
        mix_targets(torch.zeros(8, 5), K, lam)


def test_a_multi_label_run_trains_on_mixed_multi_hot_targets(tmp_path):
    from slipstream.models import build_loss

    seen, _ = seen_batches(
        tmp_path, [mixup(alpha=1.0)], train_data=multi_label_data(), loss_fn=build_loss("bce"),
        max_duration="2ba", eval_interval=None, checkpoint_interval=None,
    )  # fmt: skip
    assert len(seen) == 2
    for (x, soft, loss, out), raw_x, raw_y in zip(seen, RAW_TRAIN.split(16), MULTI_HOT.split(16), strict=False):
        apart = (raw_x - raw_x.roll(1, 0)).flatten()
        at = apart.abs().argmax()  # x = lam * raw + (1 - lam) * neighbour: lam where they differ most
        lam = float((x - raw_x.roll(1, 0)).flatten()[at] / apart[at])
        assert torch.allclose(soft, mix_targets(raw_y, K, lam), atol=1e-4)
        assert not torch.equal(soft, raw_y)
        assert loss.item() == pytest.approx(F.binary_cross_entropy_with_logits(out, soft).item(), rel=1e-5)
