"""cutmix: a box of each image's neighbour is pasted in and the labels mixed by the
box's area, reproducibly and bit-exactly across a resume; evaluation is untouched; it
composes with label_smoothing; with mixup the two switch per batch (switch_prob), never
both on one batch; bad config fails early."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from slipstream_cutmix import Cutmix, cutmix_batch, cutmix_box
from slipstream_label_smoothing import LabelSmoothing, LabelSmoothingConfig
from slipstream_mixup import Mixup, mix_targets, switch_to_cutmix

from helpers import Probe, tiny_loaders
from helpers import train as _train
from slipstream import ConfigError
from slipstream.plugins.discovery import PluginInfo, discover, plugin_config, resolve_order

RAW_TRAIN, RAW_EVAL = (torch.cat([x for x, _ in loader]) for loader in tiny_loaders())
LABELS = torch.cat([y for _, y in tiny_loaders()[0]])
K = 4
INSTALLED = discover(load=False)


def train(tmp_path, algos, **kwargs):
    known = {a.name: PluginInfo(a.name, "tests", "0", "helpers", cls=type(a)) for a in algos}
    return _train(tmp_path, algos, installed={**INSTALLED, **known}, **kwargs)


def cutmix(**options) -> Cutmix:
    return Cutmix(plugin_config(Cutmix, options))


def seen_batches(tmp_path, algos, **kwargs):
    """(inputs, targets, loss, logits) at each training batch."""
    seen: list[list] = []
    probe = Probe(
        before_forward=lambda s: seen.append([s.batch[0].clone(), s.batch[1].clone()]),
        after_forward=lambda s: seen[-1].append(s.outputs.detach().clone()),
        after_loss=lambda s: seen[-1].insert(2, s.loss.detach().clone()),
    )
    trainer = train(tmp_path, [*algos, probe], **kwargs)
    return seen, trainer


def _inside(box, shape):
    top, bottom, left, right = box
    mask = torch.zeros(shape, dtype=torch.bool)
    mask[..., top:bottom, left:right] = True
    return mask


# -- the pure functions --------------------------------------------------------------


def test_cutmix_batch_pastes_the_neighbours_box_and_mixes_labels_by_area():
    x = torch.randint(0, 256, (6, 3, 16, 16), dtype=torch.uint8)
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    kept = x.clone()
    box = (2, 10, 4, 8)  # 8 x 4 of 16 x 16: an eighth of the image
    out, soft, lam = cutmix_batch(x, y, K, box=box)
    inside = _inside(box, x.shape)
    assert out.dtype == torch.uint8 and torch.equal(x, kept)  # pixels moved, not converted
    assert torch.equal(out[inside], x.roll(1, 0)[inside]) and torch.equal(out[~inside], x[~inside])
    assert lam == 1 - 32 / 256
    assert torch.allclose(soft, mix_targets(y, K, lam)) and torch.allclose(soft.sum(1), torch.ones(6))


def test_the_box_follows_lambda_and_is_clipped_and_minmax_bounds_its_sides():
    rng = np.random.default_rng(0)
    for lam in (0.1, 0.5, 0.9):
        for _ in range(20):
            top, bottom, left, right = cutmix_box(32, 32, lam, rng)
            assert 0 <= top <= bottom <= 32 and 0 <= left <= right <= 32
            assert (bottom - top) * (right - left) <= (1 - lam) * 32 * 32 + 1e-9
    for _ in range(20):
        top, bottom, left, right = cutmix_box(32, 32, 1.0, rng, minmax=[0.25, 0.5])
        assert 8 <= bottom - top <= 16 and 8 <= right - left <= 16
        assert 0 <= top and bottom <= 32 and 0 <= left and right <= 32  # wholly inside


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"alpha": -1}, "algorithms.cutmix: alpha must be a finite number > 0"),
        ({"prob": -0.1}, "algorithms.cutmix: prob must be a finite number in [0, 1]"),
        ({"minmax": [0.5, 0.2]}, "algorithms.cutmix: minmax must be null or [min, max]"),
        ({"minmax": [0.2]}, "algorithms.cutmix: minmax must be null or [min, max]"),
        ({"switch_prob": 1.5}, "algorithms.cutmix: switch_prob must be a finite number in [0, 1]"),
    ],
)
def test_bad_config_names_the_key(options, message):
    with pytest.raises(ConfigError) as info:
        plugin_config(Cutmix, options)
    assert str(info.value).startswith(message)


def test_mixup_and_cutmix_together_are_no_longer_refused():
    assert [a.name for a in resolve_order([Mixup(), Cutmix()])] == ["mixup", "cutmix"]
    assert [a.name for a in resolve_order([Cutmix(), Mixup()])] == ["cutmix", "mixup"]


def test_the_switch_draw_is_seeded_per_batch_and_its_probability_bounds_it():
    draws = [switch_to_cutmix(3, 0, b, 0.5) for b in range(64)]
    assert draws == [switch_to_cutmix(3, 0, b, 0.5) for b in range(64)]
    assert draws != [switch_to_cutmix(4, 0, b, 0.5) for b in range(64)]
    assert 16 < sum(draws) < 48
    assert not any(switch_to_cutmix(3, 0, b, 0.0) for b in range(64))
    assert all(switch_to_cutmix(3, 0, b, 1.0) for b in range(64))


# -- in training -----------------------------------------------------------------------


def test_training_batches_are_cut_and_mixed_and_off_leaves_them_raw(tmp_path):
    raw = list(RAW_TRAIN.split(16))[:3]
    labels = list(LABELS.split(16))[:3]
    off, _ = seen_batches(tmp_path / "off", [cutmix(prob=0.0)], max_duration="3ba")
    assert all(torch.equal(x, r) for (x, *_), r in zip(off, raw, strict=True))
    assert all(torch.equal(t, y) for (_, t, *_), y in zip(off, labels, strict=True))
    on, _ = seen_batches(tmp_path / "on", [cutmix()], max_duration="3ba")
    for (x, soft, *_), r, y in zip(on, raw, labels, strict=True):
        changed = (x != r).any(dim=(0, 1))  # the pasted box, in pixel coordinates
        rows, cols = changed.any(dim=1).nonzero(), changed.any(dim=0).nonzero()
        box = (int(rows.min()), int(rows.max()) + 1, int(cols.min()), int(cols.max()) + 1)
        inside = _inside(box, x.shape)
        assert torch.equal(x[inside], r.roll(1, 0)[inside]) and torch.equal(x[~inside], r[~inside])
        lam = 1 - (box[1] - box[0]) * (box[3] - box[2]) / (16 * 16)
        assert torch.allclose(soft, mix_targets(y, K, lam))


def test_evaluation_is_untouched(tmp_path):
    seen: list[torch.Tensor] = []
    trainer = train(tmp_path, [cutmix(), Probe(eval_batch_start=lambda s: seen.append(s.batch[0].clone()))])
    assert torch.equal(torch.cat(seen[-4:]), RAW_EVAL)
    assert "loss" in trainer.state.eval_metrics


def test_a_resumed_run_continues_bit_exactly(tmp_path):
    whole, straight = seen_batches(tmp_path / "whole", [cutmix()], max_duration="6ba", checkpoint_interval=None)
    first = train(tmp_path / "half", [cutmix()], max_duration="3ba", checkpoint_interval="3ba")
    latest = first.run_dir / "checkpoints" / "latest.pt"
    resumed, trainer = seen_batches(tmp_path / "half", [cutmix()], max_duration="6ba", load_path=latest)
    for a, b in zip(whole[3:], resumed, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    for p, q in zip(straight.state.model.parameters(), trainer.state.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_composes_with_label_smoothing(tmp_path):
    smoothing = 0.1
    algos = [cutmix(), LabelSmoothing(LabelSmoothingConfig(smoothing))]
    seen, _ = seen_batches(tmp_path, algos, max_duration="2ba")
    for _, soft, loss, out in seen:
        target = (1 - smoothing) * soft + smoothing / K
        expected = -(target * out.log_softmax(dim=1)).sum(dim=1).mean()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
        assert loss.item() != pytest.approx(F.cross_entropy(out, soft).item(), rel=1e-4)


# -- with mixup: one of the two per batch ----------------------------------------------


def _kind(x, soft, raw, labels) -> str:
    """Which mixing a batch got: 'cutmix' (every pixel its own or its neighbour's, the
    labels mixed by the changed area), 'mixup' (the lerp of the labels' lam) or 'none'."""
    if torch.equal(x, raw):
        return "none"
    if bool(((x == raw) | (x == raw.roll(1, 0))).all()):
        changed = (x != raw).any(dim=(0, 1))
        rows, cols = changed.any(dim=1).nonzero(), changed.any(dim=0).nonzero()
        area = (int(rows.max()) + 1 - int(rows.min())) * (int(cols.max()) + 1 - int(cols.min()))
        assert torch.allclose(soft, mix_targets(labels, K, 1 - area / x[0, 0].numel()))
        return "cutmix"
    lam = soft[0, labels[0]].item()  # neighbours are of different classes in this data
    assert torch.allclose(x, torch.lerp(raw.roll(1, 0), raw, lam), atol=1e-6)  # mixed once, not cut too
    assert torch.allclose(soft, mix_targets(labels, K, lam))
    return "mixup"


def switched(tmp_path, switch_prob=0.5, batches=8, **kwargs):
    mix = Mixup(plugin_config(Mixup, {"alpha": 1.0}))
    algos = [mix, cutmix(switch_prob=switch_prob)]
    seen, trainer = seen_batches(tmp_path, algos, max_duration=f"{batches}ba", **kwargs)
    raw, labels = RAW_TRAIN.split(16), LABELS.split(16)
    kinds = [_kind(x, soft, raw[i % 4], labels[i % 4]) for i, (x, soft, *_) in enumerate(seen)]
    return kinds, seen, trainer


def test_with_mixup_each_batch_is_cut_or_mixed_as_the_seeded_draw_says_never_both(tmp_path):
    kinds, seen, trainer = switched(tmp_path / "a")
    seed = trainer.state.seed
    expected = ["cutmix" if switch_to_cutmix(seed, 0, b, 0.5) else "mixup" for b in range(8)]
    assert kinds == expected and set(kinds) == {"cutmix", "mixup"}  # both kinds, one per batch
    again, seen_again, _ = switched(tmp_path / "b")  # the same seed: the same choices and batches
    assert again == kinds
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(seen, seen_again, strict=True))


@pytest.mark.parametrize(("switch_prob", "kind"), [(0.0, "mixup"), (1.0, "cutmix")])
def test_switch_prob_0_is_always_mixup_and_1_always_cutmix(tmp_path, switch_prob, kind):
    kinds, _, _ = switched(tmp_path, switch_prob=switch_prob, batches=4)
    assert kinds == [kind] * 4


def test_the_switch_resumes_bit_exactly(tmp_path):
    def algos():
        return [Mixup(plugin_config(Mixup, {"alpha": 1.0})), cutmix()]

    whole, straight = seen_batches(tmp_path / "whole", algos(), max_duration="6ba", checkpoint_interval=None)
    first = train(tmp_path / "half", algos(), max_duration="3ba", checkpoint_interval="3ba")
    latest = first.run_dir / "checkpoints" / "latest.pt"
    resumed, trainer = seen_batches(tmp_path / "half", algos(), max_duration="6ba", load_path=latest)
    assert len(resumed) == 3
    for a, b in zip(whole[3:], resumed, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    for p, q in zip(straight.state.model.parameters(), trainer.state.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_multi_label_run_cuts_and_mixes_multi_hot_targets_by_area(tmp_path):
    from slipstream.models import build_loss

    multi_hot = (torch.arange(64).unsqueeze(1) // torch.tensor([1, 2, 3, 5]) % 2).float()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(RAW_TRAIN, multi_hot), batch_size=16)
    seen, _ = seen_batches(
        tmp_path, [cutmix()], train_data=data, loss_fn=build_loss("bce"), max_duration="2ba",
        eval_interval=None, checkpoint_interval=None,
    )  # fmt: skip
    assert len(seen) == 2
    for (x, soft, loss, out), raw, y in zip(seen, RAW_TRAIN.split(16), multi_hot.split(16), strict=False):
        pasted = (x != raw).any(dim=1)[0]  # where the neighbour's box lies (random pixels: all differ)
        lam = 1 - pasted.float().mean().item()
        assert 0 < lam < 1
        assert torch.allclose(soft, mix_targets(y, K, lam), atol=1e-6)
        assert loss.item() == pytest.approx(F.binary_cross_entropy_with_logits(out, soft).item(), rel=1e-5)
