"""selective_backprop: inside its window, every batch but each interrupt-th trains on the
part of it with the highest loss (scored by a no-grad pass, at scale_factor of the
size); nothing changes without it; the draw is seeded (resume exact); bad options
and a model that cannot take the scaled size refused in one line."""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict

import pytest
import timm
import torch
import torch.nn.functional as F
from slipstream_selective_backprop import (
    SelectiveBackprop,
    kept_count,
    select_indices,
    select_using_loss,
    should_selective_backprop,
)

from helpers import Probe, train
from slipstream import ConfigError
from slipstream.plugins.discovery import PluginInfo, discover, plugin_config

# tiny_loaders: 4 batches of 16 an epoch; 8 batches: the window [0.5, 0.9) holds batches
# 4-7, of which 4 and 6 are selective (5 and 7 are interrupt=2's plain ones).
SELECTIVE = [4, 6]


INSTALLED = discover(load=False)


def installed(algos) -> dict[str, PluginInfo]:
    """The installed plugins, looked up once, and the tests' probes: no entry-point scan per run."""
    known = {a.name: PluginInfo(a.name, "tests", "0", "helpers", cls=type(a)) for a in algos}
    return {**INSTALLED, **known, "probe": PluginInfo("probe", "tests", "0", "helpers", cls=Probe)}


def sb(**options) -> SelectiveBackprop:
    return SelectiveBackprop(plugin_config(SelectiveBackprop, options))


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(OrderedDict(
        conv=torch.nn.Conv2d(3, 8, 3, stride=2, padding=1),
        bn=torch.nn.BatchNorm2d(8),
        act=torch.nn.ReLU(),
        pool=torch.nn.AdaptiveAvgPool2d(2),
        flat=torch.nn.Flatten(),
        fc=torch.nn.Linear(32, 4),
    ))  # fmt: skip


def buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.buffers()]


def run(tmp_path, algos, max_duration="8ba", stop_at=None, **kwargs):
    """Train small_model; per batch, the batch before the plugin's before_forward with a
    copy of the model then, and the batch after it (what the model trains on) with the
    model's buffers then."""
    before: list[tuple[torch.Tensor, torch.Tensor, torch.nn.Module]] = []
    after: list[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]] = []
    first = Probe(before_forward=lambda s: before.append(
        (s.batch[0].clone(), s.batch[1].clone(), copy.deepcopy(s.unwrapped_model))))
    first.name = "first"
    last = Probe(before_forward=lambda s: after.append(
                     (s.batch[0].clone(), s.batch[1].clone(), buffers(s.unwrapped_model))),
                 batch_end=lambda s: setattr(s, "stop_requested", s.timestamp.batch == stop_at))  # fmt: skip
    kwargs.setdefault("eval_interval", None)
    kwargs.setdefault("checkpoint_interval", None)
    model = kwargs.pop("model", None) or small_model()
    kwargs.setdefault("threads", 1)
    kwargs.setdefault("installed", installed([first, *algos]))
    trainer = train(tmp_path, [first, *algos, last], model=model, max_duration=max_duration, **kwargs)
    return trainer, before, after


def scores(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-sample cross-entropy of a copy of the model in training mode, as the plugin scores."""
    with torch.no_grad():
        return F.cross_entropy(copy.deepcopy(model)(x), y, reduction="none")


def test_selective_batches_keep_the_highest_losses_and_none_without_it(tmp_path):
    trainer, before, after = run(tmp_path, [sb(selection="top")])
    assert [len(x) for x, _, _ in after] == [16] * 4 + [8, 16, 8, 16]
    for b in SELECTIVE:
        x, y, model = before[b]
        losses = scores(model, x, y)
        top = losses.argsort(descending=True)[:8].sort().values
        assert torch.equal(after[b][0], x[top]) and torch.equal(after[b][1], y[top])
        # The scoring pass left the batch-norm statistics as they were: the trained pass counts once.
        assert all(torch.equal(a, c) for a, c in zip(buffers(model), after[b][2], strict=True))
    assert trainer.summary["selective_backprop"] == {"steps": 2, "scored": 32, "kept": 16}
    _, _, plain = run(tmp_path / "off", [])  # off: every sample trains
    assert [len(x) for x, _, _ in plain] == [16] * 8


def test_composer_sampling_favours_high_losses_and_is_seeded():
    losses = torch.arange(8.0).flip(0)  # sample 0 has the highest loss
    counts = torch.zeros(8)
    for seed in range(400):
        chosen = select_indices(losses, 0.5, torch.Generator().manual_seed(seed))
        assert len(chosen) == kept_count(8, 0.5) == 4 and torch.equal(chosen, chosen.sort().values)
        counts[chosen] += 1
    # keep=0.5: probability rising linearly with the loss percentile (1/16, 3/16, ... 15/16 of a draw).
    assert counts[0] > counts[3] > counts[7] and counts[:4].sum() > 2 * counts[4:].sum()
    again = [select_indices(losses, 0.5, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(*again)
    assert [should_selective_backprop(t, b, 0.5, 0.9, 3) for t, b in ((0.5, 0), (0.5, 2), (0.89, 1), (0.9, 0))] == [
        True, False, True, False]  # fmt: skip


def test_resume_mid_run_is_exact(tmp_path):
    # 6 batches from 0.25: batches 2 and 4 selective; stopped after 4, so the resumed run has one.
    straight, _, _ = run(tmp_path / "straight", [sb(start=0.25)], max_duration="6ba")
    half, _, _ = run(tmp_path / "half", [sb(start=0.25)], max_duration="6ba", stop_at=4, checkpoint_interval="4ba")
    latest = half.run_dir / "checkpoints" / "latest.pt"
    resumed, _, _ = run(tmp_path / "resumed", [sb(start=0.25)], max_duration="6ba", load_path=latest)
    a, b = straight.state.unwrapped_model.state_dict(), resumed.state.unwrapped_model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.summary["selective_backprop"] == straight.summary["selective_backprop"] == {
        "steps": 2, "scored": 32, "kept": 16}  # fmt: skip


def test_soft_targets_scaled_scoring_and_autocast(tmp_path):
    """With mixup the kept rows are the mixed batch's, scored against its soft targets;
    the scoring pass sees half-size images, in bf16 under mixed_precision."""
    info = discover()
    mixup, mp = info["mixup"].cls, info["mixed_precision"].cls
    model = small_model()
    calls: list[tuple[tuple[int, ...], torch.dtype, bool]] = []
    model.register_forward_hook(lambda m, i, o: calls.append((tuple(i[0].shape), o.dtype, torch.is_grad_enabled())))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 on a CPU without bf16 units
        # 4 batches: batch 2 alone is selective ([0.5, 0.75) of the run).
        _, before, after = run(tmp_path, [sb(selection="top", scale_factor=0.5, start=0.5, end=0.75),
                                          mixup(plugin_config(mixup, {})), mp(plugin_config(mp, {"dtype": "bf16"}))],
                               model=model, max_duration="4ba")  # fmt: skip
    scoring = [c for c in calls if not c[2]]
    assert scoring == [((16, 3, 8, 8), torch.bfloat16, False)]  # batch 2 alone, half size, bf16
    x, y, scored_model = before[2]
    assert y.ndim == 2 and after[2][1].shape == (8, 4)  # soft targets, 8 rows kept
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        losses = F.cross_entropy(scored_model(F.interpolate(x, scale_factor=0.5, mode="bilinear")).float(), y,
                                 reduction="none")  # fmt: skip
    top = losses.argsort(descending=True, stable=True)[:8].sort().values
    assert torch.equal(after[2][0], x[top]) and torch.equal(after[2][1], y[top])


def test_functional_select_using_loss():
    model = small_model()
    x, y = torch.rand(16, 3, 16, 16), torch.arange(16) % 4
    with torch.no_grad():
        losses = F.cross_entropy(copy.deepcopy(model)(x), y, reduction="none")
    kept_x, kept_y = select_using_loss(x, y, model, torch.nn.CrossEntropyLoss(), keep=0.25, selection="top")
    top = losses.argsort(descending=True)[:4].sort().values
    assert torch.equal(kept_x, x[top]) and torch.equal(kept_y, y[top])


def test_bad_options_and_a_fixed_size_vit_are_refused_in_one_line(tmp_path):
    for bad, allowed in (({"start": 0.9, "end": 0.5}, "end must be above start"),
                         ({"keep": 0}, "keep must be"),
                         ({"keep": 1.5}, "keep must be"),
                         ({"scale_factor": 2}, "scale_factor must be"),
                         ({"interrupt": -1}, "interrupt must be"),
                         ({"selection": "max"}, "selection must be one of"),
                         ({"fraction": 0.5}, "fraction")):  # fmt: skip
        with pytest.raises(ConfigError) as error:
            plugin_config(SelectiveBackprop, bad)
        message = str(error.value)
        assert "\n" not in message and message.startswith("algorithms.selective_backprop") and allowed in message
    torch.manual_seed(0)
    vit = timm.create_model("test_vit", num_classes=4, img_size=16, patch_size=8, dynamic_img_size=False)
    with pytest.raises(ConfigError, match=r"scale_factor < 1: VisionTransformer only takes its own input size"):
        run(tmp_path, [sb(scale_factor=0.5)], model=vit, max_duration="1ba")
