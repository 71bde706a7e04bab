"""ghost_batchnorm: batch norm layers normalise chunks of ghost_batch_size samples in
training (plain batch norm for a batch of one ghost size, and in evaluation), in place
with the same parameters and state_dict keys, so a ghost run's checkpoint loads and
evaluates in the plain model; refused by name on a model without batch norm; bad
options in one line; a resumed run bit-exact."""

from __future__ import annotations

import copy
import pickle

import pytest
import timm
import torch
import torch.nn.functional as F
from slipstream_ghost_batchnorm import (
    GhostBatchNorm,
    GhostBatchNorm1d,
    GhostBatchNorm2d,
    apply_ghost_batchnorm,
    ghost_chunks,
    ghost_layers,
    remove_ghost_batchnorm,
)
from torch import nn

from helpers import error_lines, tiny_model
from helpers import train as _train
from slipstream import Algorithm, ConfigError
from slipstream.plugins.discovery import PluginInfo, discover, plugin_config, resolve_order

INSTALLED = discover(load=False)


@pytest.fixture(autouse=True)
def _no_flop_count(monkeypatch):
    # Counting FLOPs for MFU (a meta copy, forward and backward) costs these tiny runs
    # 4x their training, and no test here reads MFU.
    monkeypatch.setattr("slipstream.services.utilization.training_flops_per_sample", lambda model, inputs: 0.0)


def train(tmp_path, algos, **kwargs):
    known = {a.name: PluginInfo(a.name, "tests", "0", "helpers", cls=type(a)) for a in algos}
    return _train(tmp_path, algos, installed={**INSTALLED, **known}, **kwargs)


def ghost(**options) -> GhostBatchNorm:
    return GhostBatchNorm(plugin_config(GhostBatchNorm, options))


def per_chunk_reference(bn: nn.BatchNorm2d, x: torch.Tensor, chunks: int) -> tuple[torch.Tensor, ...]:
    """Hand-written ghost batch norm: each chunk normalised by its own statistics, the
    running statistics updated chunk after chunk with momentum / chunks."""
    mean, var = bn.running_mean.clone(), bn.running_var.clone()
    outs = [
        F.batch_norm(part, mean, var, bn.weight, bn.bias, True, bn.momentum / chunks, bn.eps)
        for part in x.tensor_split(chunks)
    ]
    return torch.cat(outs), mean, var


# -- the functional API -----------------------------------------------------------------


def test_chunks_are_normalised_apart_and_one_ghost_size_is_plain_batch_norm():
    torch.manual_seed(0)
    plain = nn.BatchNorm2d(3).train()
    nn.init.normal_(plain.weight)
    x = torch.randn(10, 3, 4, 4) * 3 + 1
    bn = copy.deepcopy(plain)
    params = list(bn.parameters())
    assert apply_ghost_batchnorm(bn, ghost_batch_size=4) == 1
    assert type(bn) is GhostBatchNorm2d and all(a is b for a, b in zip(params, bn.parameters(), strict=True))
    assert ghost_chunks(10, 4) == 3  # 4 + 3 + 3 samples
    expected, mean, var = per_chunk_reference(plain, x, 3)
    out = bn(x)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(bn.running_mean, mean)
    torch.testing.assert_close(bn.running_var, var)
    assert not torch.allclose(out, copy.deepcopy(plain)(x), atol=1e-3)  # not plain batch norm
    assert bn.momentum == plain.momentum and int(bn.num_batches_tracked) == 3  # restored; chunks counted
    # A batch of one ghost size (or less) is exactly plain batch norm; so is evaluation.
    again, reference = copy.deepcopy(bn), copy.deepcopy(bn)
    remove_ghost_batchnorm(reference)
    assert torch.equal(again(x[:4]), reference(x[:4]))
    assert torch.equal(again.running_mean, reference.running_mean)
    assert torch.equal(again.eval()(x), reference.eval()(x))


def test_a_resnet_changes_in_place_with_the_same_keys_and_undoes():
    model = tiny_model()
    params, keys = list(model.parameters()), list(model.state_dict())
    x = torch.rand(8, 3, 16, 16)
    plain = copy.deepcopy(model)
    n = apply_ghost_batchnorm(model, ghost_batch_size=4)
    assert n == len([m for m in plain.modules() if isinstance(m, nn.BatchNorm2d)]) == len(ghost_layers(model))
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    assert list(model.state_dict()) == keys
    assert not torch.allclose(model(x), plain(x), atol=1e-4)  # training: ghost statistics
    assert apply_ghost_batchnorm(model, ghost_batch_size=8) == n  # applied again: the new size
    assert {m.ghost_batch_size for m in model.modules() if isinstance(m, GhostBatchNorm2d)} == {8}
    model.eval(), plain.eval()
    restored = copy.deepcopy(model)
    assert remove_ghost_batchnorm(restored) == n and not ghost_layers(restored)
    assert type(restored.bn1) is nn.BatchNorm2d and "ghost_batch_size" not in vars(restored.bn1)
    assert torch.equal(restored(x), model(x))
    pickle.loads(pickle.dumps(model))  # the made classes are importable by name


def test_1d_inputs_subclasses_and_channels_last():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6))
    apply_ghost_batchnorm(mlp, ghost_batch_size=3)
    assert type(mlp[1]) is GhostBatchNorm1d
    x = torch.randn(6, 5)
    out = mlp(x)
    assert torch.allclose(out[:3].mean(0), torch.zeros(6), atol=1e-5)  # each chunk centred by itself
    # timm's BatchNormAct2d: batch norm then activation, per chunk (its forward is kept).
    norm_act = timm.layers.BatchNormAct2d(4, act_layer=nn.ReLU)
    apply_ghost_batchnorm(norm_act, ghost_batch_size=2)
    assert type(norm_act).__name__ == "GhostBatchNormAct2d" and isinstance(norm_act, timm.layers.BatchNormAct2d)
    assert norm_act(torch.randn(6, 4, 3, 3)).min() == 0
    # Channels-last in, channels-last out, with the same values.
    bn = nn.BatchNorm2d(4)
    apply_ghost_batchnorm(bn, ghost_batch_size=2)
    x = torch.randn(6, 4, 3, 3)
    nchw = copy.deepcopy(bn)(x)
    nhwc = bn(x.contiguous(memory_format=torch.channels_last))
    assert nhwc.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(nhwc, nchw)
    with pytest.raises(ValueError, match=r"ghost_batch_size must be a whole number >= 2"):
        apply_ghost_batchnorm(nn.BatchNorm2d(2), ghost_batch_size=1)


# -- in training ------------------------------------------------------------------------


def test_a_batch_no_larger_than_the_ghost_size_warns(tmp_path):
    with pytest.warns(UserWarning, match=r"batches of 16 samples per process are no larger than ghost_batch_size=32"):
        run = train(tmp_path, [ghost()], max_duration="1ba", eval_interval=None, checkpoint_interval=None)
    assert run.summary["ghost_batchnorm"]["chunks"] == 1


def test_a_model_without_batch_norm_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError) as info:
        train(tmp_path, [ghost()], model=tiny_model("vit"), max_duration="1ba")
    message = str(info.value)
    assert len(error_lines(message)) == 1
    assert message.startswith("ghost_batchnorm cannot change VisionTransformer: it has no BatchNorm1d/2d/3d")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ghost_batch_size": 1}, r"ghost_batch_size must be a whole number >= 2"),
        ({"ghost_batch_size": 2.5}, r"ghost_batch_size: Value '2.5' .* could not be converted to Integer"),
        ({"ghost_batch_size": "big"}, r"ghost_batch_size: Value 'big'"),
        ({"chunks": 2}, r"unknown key 'chunks'.*allowed keys: ghost_batch_size"),
    ],
)
def test_bad_options_are_one_line_naming_the_key(options, message):
    with pytest.raises(ConfigError, match=message) as info:
        plugin_config(GhostBatchNorm, options)
    assert "algorithms.ghost_batchnorm" in str(info.value) and len(error_lines(str(info.value))) == 1


def test_a_run_trains_with_ghost_statistics_resumes_bit_exactly_and_evaluates_in_the_plain_model(tmp_path):
    quick = {"eval_interval": None}
    whole = train(tmp_path / "whole", [ghost(ghost_batch_size=4)], max_duration="4ba", **quick)
    layers = ghost_layers(whole.state.unwrapped_model)
    assert "bn1" in layers
    assert whole.summary["ghost_batchnorm"] == {"layers": len(layers), "ghost_batch_size": 4, "batch_size": 16,
                                                "chunks": 4}
    # Off: plain batch norm, other statistics and (through them) other weights.
    off = train(tmp_path / "off", [], max_duration="4ba", **quick)
    assert not ghost_layers(off.state.unwrapped_model)
    a, b = whole.state.unwrapped_model.state_dict(), off.state.unwrapped_model.state_dict()
    assert a.keys() == b.keys()
    assert not torch.equal(a["bn1.running_var"], b["bn1.running_var"])
    assert not torch.equal(a["fc.weight"], b["fc.weight"])
    # Resumed from a checkpoint after batch 2: the same weights and statistics bit for bit.
    first = train(tmp_path / "half", [ghost(ghost_batch_size=4)], max_duration="2ba", checkpoint_interval="2ba",
                  **quick)
    latest = first.run_dir / "checkpoints" / "latest.pt"
    resumed = train(tmp_path / "half", [ghost(ghost_batch_size=4)], max_duration="4ba", load_path=latest, **quick)
    assert resumed.summary["batches"] == 4
    b = resumed.state.unwrapped_model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The checkpoint (the resumed run's, at its end) loads into the plain model, which
    # evaluates as the ghost one does ...
    plain = tiny_model().eval()
    plain.load_state_dict(torch.load(latest, weights_only=True)["model"])
    trained = resumed.state.unwrapped_model.eval()
    x = torch.rand(8, 3, 16, 16)
    assert torch.equal(plain(x), trained(x))
    # ... and the export is that plain model.
    exported = GhostBatchNorm().export_model(copy.deepcopy(trained))
    assert not ghost_layers(exported) and torch.equal(exported(x), plain(x))


def test_surgery_comes_first_and_sync_batchnorm_is_refused_by_name():
    others = ["ema", "channels_last", "activation_checkpointing", "fsdp", "torch_compile"]
    stand_ins = [type(n, (Algorithm,), {"name": n})() for n in others]
    order = [a.name for a in resolve_order([*stand_ins, ghost()])]
    assert all(order.index("ghost_batchnorm") < order.index(n) for n in others)
    sync = type("SyncStandIn", (Algorithm,), {"name": "sync_batchnorm"})()
    with pytest.raises(Exception, match=r"'ghost_batchnorm' conflicts with 'sync_batchnorm' \(ghost batch norm"):
        resolve_order([ghost(), sync])
