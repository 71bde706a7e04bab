"""cutmix: a box of each image's neighbour is pasted in and the labels mixed by the
box's area, reproducibly and bit-exactly across a resume; evaluation is untouched; it
composes with label_smoothing and conflicts with mixup; bad config fails early."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from slipstream_cutmix import Cutmix, cutmix_batch, cutmix_box
from slipstream_label_smoothing import LabelSmoothing, LabelSmoothingConfig
from slipstream_mixup import Mixup, mix_targets

from helpers import Probe, tiny_loaders
from helpers import train as _train
from slipstream import ConfigError, PluginError
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
    ],
)
def test_bad_config_names_the_key(options, message):
    with pytest.raises(ConfigError) as info:
        plugin_config(Cutmix, options)
    assert str(info.value).startswith(message)


def test_mixup_and_cutmix_together_are_refused_naming_both():
    why = r"\(both mix every batch and its labels.*\)"
    with pytest.raises(PluginError, match=rf"'mixup' conflicts with 'cutmix' {why}; enable only one of them"):
        resolve_order([Mixup(), Cutmix()])
    with pytest.raises(PluginError, match="'cutmix' conflicts with 'mixup'"):
        resolve_order([Cutmix(), Mixup()])


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
