"""layer_freezing: the earliest layers frozen progressively from freeze_start (no
gradient, no optimizer step), exactly the scheduled set after each step; nothing
frozen without it; a resumed run exact; bad options and unworkable pairs refused."""

from __future__ import annotations

import pytest
import timm
import torch
from slipstream_layer_freezing import (
    LayerFreezing,
    freeze_layers,
    freeze_schedule,
    frozen_depth,
    layers,
)
from torch import nn

from helpers import Probe, train
from slipstream import ConfigError, SlipstreamError, State
from slipstream.plugins.discovery import PluginInfo, discover, plugin_config, resolve_order

LAYERS = 6  # small(): three convolutions, two batch norms and the head


INSTALLED = discover(load=False)


def installed(algos) -> dict[str, PluginInfo]:
    """The installed plugins, looked up once, and the tests' probes: no entry-point scan per run."""
    known = {a.name: PluginInfo(a.name, "tests", "0", "helpers", cls=type(a)) for a in algos}
    return {**INSTALLED, **known, "probe": PluginInfo("probe", "tests", "0", "helpers", cls=Probe)}


def lf(**options) -> LayerFreezing:
    return LayerFreezing(plugin_config(LayerFreezing, options))


def small() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def run(tmp_path, algos, max_duration="8ba", stop_at=None, **kwargs):
    """Train (stopped after batch ``stop_at``); the parameters after each batch."""
    after: list[dict[str, torch.Tensor]] = []

    def batch_end(s):
        after.append(params(s.unwrapped_model))
        s.stop_requested = s.timestamp.batch == stop_at

    probe = Probe(batch_end=batch_end)
    kwargs.setdefault("eval_interval", None)
    kwargs.setdefault("checkpoint_interval", None)
    model = kwargs.pop("model", None) or small()
    kwargs.setdefault("threads", 1)
    kwargs.setdefault("installed", installed(algos))
    trainer = train(tmp_path, [*algos, probe], model=model, max_duration=max_duration, **kwargs)
    return trainer, [params(small()), *after]


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[str]:
    return {k for k in before if not torch.equal(before[k], after[k])}


def layer_params(model: nn.Module, depth: int) -> set[str]:
    """The names of the parameters of the first ``depth`` layers."""
    prefix = {name for name, _ in layers(model)[:depth]}
    return {k for k, _ in model.named_parameters() if k.rpartition(".")[0] in prefix}


def test_exactly_the_scheduled_layers_stop_changing_and_none_without_it(tmp_path):
    trainer, history = run(tmp_path, [lf()])  # 8 batches: freezing from batch 4 on
    model = trainer.state.unwrapped_model
    names = set(history[0])
    depths = [frozen_depth(LAYERS, b / 8) for b in range(8)]  # frozen while batch b trains
    assert depths[:5] == [0] * 5 and depths[5] > 0 and depths == sorted(depths)
    for b in range(8):
        assert changed(history[b], history[b + 1]) == names - layer_params(model, depths[b]), b
    # At the end all but the head are frozen; nothing requires a gradient but the head.
    assert trainer.summary["layer_freezing"]["frozen_layers"] == LAYERS - 1
    assert {k for k, p in model.named_parameters() if p.requires_grad} == {"9.weight", "9.bias"}
    _, plain = run(tmp_path / "plain", [])
    assert all(changed(plain[b], plain[b + 1]) == names for b in range(8))


def test_epoch_interval_freezes_at_epoch_ends_only(tmp_path):
    seen: list[int] = []
    plugin = lf(freeze_start=0.0, interval="epoch")
    probe = Probe(batch_end=lambda s: seen.append(plugin.depth))
    train(tmp_path, [plugin, probe], model=small(), max_duration="8ba", eval_interval=None,
          checkpoint_interval=None, threads=1, installed=installed([plugin]))  # fmt: skip
    # Epochs of 4 batches: the set grows at the first epoch's end (seen from batch 5 on).
    assert seen == [0, 0, 0, 0] + [frozen_depth(LAYERS, 0.5, 0.0)] * 4 and seen[4] == 2


def test_resume_mid_run_is_exact(tmp_path):
    straight, _ = run(tmp_path / "straight", [lf(freeze_start=0.25)])
    # Stopped after batch 5 of the same 8-batch run (its schedule is the straight run's).
    half, _ = run(tmp_path / "half", [lf(freeze_start=0.25)], stop_at=5, checkpoint_interval="5ba")
    assert half.state.algorithms[0].depth > 0  # the checkpoint holds a frozen set
    latest = half.run_dir / "checkpoints" / "latest.pt"
    resumed, _ = run(tmp_path / "resumed", [lf(freeze_start=0.25)], load_path=latest)
    a, b = straight.state.unwrapped_model.state_dict(), resumed.state.unwrapped_model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_functional_api_and_what_a_layer_is():
    vit = timm.create_model("test_vit", num_classes=4, img_size=16, patch_size=8)
    found = layers(vit)
    # A ViT's own tokens come first (before the patch embedding); the head is last.
    assert found[0][0] == "" and found[1][0] == "patch_embed.proj" and found[-1][0] == "head"
    depth, fraction = freeze_layers(vit, 0.75, freeze_start=0.5, freeze_level=1.0)
    assert (depth, fraction) == (int(0.5 * (len(found) - 1)), 0.5)
    assert not vit.pos_embed.requires_grad and not vit.cls_token.requires_grad and vit.head.weight.requires_grad
    assert freeze_layers(vit, 1.0)[0] == len(found) - 1 and vit.head.weight.requires_grad
    assert [freeze_schedule(t, 0.5, 0.8) for t in (0.5, 0.75, 1.0)] == [0.0, 0.4, 0.8]


def test_bad_options_are_one_line():
    for bad, allowed in (({"freeze_start": 1.0}, "freeze_start must be"),
                         ({"freeze_level": 1.5}, "freeze_level must be"),
                         ({"interval": "step"}, "interval must be one of"),
                         ({"freeze_end": 1}, "freeze_end")):  # fmt: skip
        with pytest.raises(ConfigError) as error:
            plugin_config(LayerFreezing, bad)
        message = str(error.value)
        assert "\n" not in message and message.startswith("algorithms.layer_freezing") and allowed in message


def test_refuses_torch_compile_fsdp_and_ddp_without_unused_parameters():
    from slipstream_fsdp import FSDP
    from slipstream_torch_compile import TorchCompile

    for name, other in (("torch_compile", TorchCompile), ("fsdp", FSDP)):
        with pytest.raises(SlipstreamError, match=name) as error:
            resolve_order([other(plugin_config(other, {})), lf()])
        assert "layer_freezing" in str(error.value) and "\n" not in str(error.value)
    model = small()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for ddp, refused in (({}, True), ({"find_unused_parameters": True}, False)):
        state = State(model=model, optimizer=opt, max_duration=None, world_size=2,
                      config={"trainer": {"ddp": ddp}})  # fmt: skip
        if refused:
            with pytest.raises(ConfigError, match="trainer.ddp.find_unused_parameters=true"):
                lf().init(state)
        else:
            lf().init(state)


def test_under_grad_accumulation_the_set_grows_after_optimizer_steps_only(tmp_path):
    from slipstream_grad_accumulation import GradAccumulation, GradAccumulationConfig

    seen: list[int] = []
    plugin = lf(freeze_start=0.0)
    probe = Probe(batch_end=lambda s: seen.append(plugin.depth))
    ga = GradAccumulation(GradAccumulationConfig(steps=2))
    train(tmp_path, [plugin, ga, probe], model=small(), max_duration="8ba", eval_interval=None,
          checkpoint_interval=None, threads=1, installed=installed([plugin, ga]))  # fmt: skip
    # Groups of 2 batches: the optimizer steps after batches 1, 3, 5, 7 (0-based).
    # The depth seen after batch b is the schedule's at the last step: at (b + 1) / 8 of the
    # run after a step, at b / 8 after the batch that opens a group.
    assert seen == [frozen_depth(LAYERS, (b + b % 2) / 8, 0.0) for b in range(8)]
    assert seen != [frozen_depth(LAYERS, (b + 1) / 8, 0.0) for b in range(8)]  # what every batch would freeze
