"""stochastic_depth: residual blocks of timm ResNets and ViTs and torchvision ResNets
dropped per sample in training, at rates rising linearly over depth; the identity at
evaluation; masks drawn per batch from a seeded generator (the global RNG untouched,
a resumed run exact); a model it cannot change, and bad options, refused in one line."""

from __future__ import annotations

import pytest
import timm
import torch
import torchvision
from slipstream_activation_checkpointing import ActivationCheckpointing
from slipstream_ema import EMA
from slipstream_stochastic_depth import (
    DropPath,
    StochasticDepth,
    apply_stochastic_depth,
    drop_paths,
    linear_rates,
    remove_stochastic_depth,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from helpers import TINY_RUN, Probe, error_lines
from helpers import train as _train
from slipstream import ConfigError
from slipstream.cli.main import main
from slipstream.plugins.discovery import PluginInfo, discover, plugin_config, resolve_order

K = 4
INSTALLED = discover(load=False)


def train(tmp_path, algos, **kwargs):
    known = {a.name: PluginInfo(a.name, "tests", "0", "helpers", cls=type(a)) for a in algos}
    return _train(tmp_path, algos, installed={**INSTALLED, **known}, **kwargs)


def sd(**options) -> StochasticDepth:
    return StochasticDepth(plugin_config(StochasticDepth, options))


def live(model: nn.Module) -> nn.Module:
    """timm zero-initialises each block's last batch-norm scale, so a fresh block's
    branch is 0 and dropping it changes nothing: scales of 1 make the drop show."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
    return model


def resnet() -> nn.Module:
    torch.manual_seed(0)
    return live(timm.create_model("test_resnet", num_classes=K))


MODELS = {
    # name: (build, image size, blocks, DropPath modules per changed block)
    "timm test_resnet": (resnet, 16, 4, 1),
    "torchvision resnet18": (lambda: torchvision.models.resnet18(num_classes=K), 16, 8, 1),
    "timm test_vit": (lambda: timm.create_model("test_vit", num_classes=K, img_size=16, patch_size=8), 16, 6, 2),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_blocks_dropped_per_sample_at_linear_rates_and_eval_is_the_identity(name):
    build, size, blocks, per_block = MODELS[name]
    torch.manual_seed(0)
    model = build().eval()
    x = torch.rand(8, 3, size, size)
    plain = model(x)
    keys = list(model.state_dict())
    assert apply_stochastic_depth(model, 0.3) == blocks - 1  # the first block's rate is 0
    rates = [p.drop_prob for p in drop_paths(model)]
    assert rates == pytest.approx([r for r in linear_rates(blocks, 0.3)[1:] for _ in range(per_block)])
    assert rates[-1] == pytest.approx(0.3)
    assert list(model.state_dict()) == keys  # no parameter, no buffer
    assert torch.equal(model(x), plain) and torch.equal(model(x), plain)  # eval: deterministic, unchanged

    model.train()
    generator = torch.Generator().manual_seed(0)
    for path in drop_paths(model):
        path.generator = generator
    rng = torch.get_rng_state()
    a, b = model(x), model(x)
    assert not torch.equal(a, b)  # other samples dropped on the same inputs
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is not drawn from

    model.eval()
    plain = model(x)  # batch norm's running statistics moved in training
    assert remove_stochastic_depth(model) == (blocks - 1) * per_block
    assert not drop_paths(model) and list(model.state_dict()) == keys
    assert torch.equal(model(x), plain)
    assert not any(m._forward_hooks for m in model.modules())


def test_drop_path_keeps_or_zeroes_whole_samples_scaled_by_keep():
    path = DropPath(0.5)
    path.mask = torch.tensor([2.0, 0.0, 2.0])
    x = torch.rand(3, 4, 5)
    assert torch.equal(path(x), x * torch.tensor([2.0, 0.0, 2.0]).view(3, 1, 1))
    path.generator = torch.Generator().manual_seed(1)
    out = path(torch.ones(400, 2))  # mask of another batch size: drawn from the generator
    assert set(out[:, 0].tolist()) == {0.0, 2.0} and torch.equal(out[:, 0], out[:, 1])
    assert torch.equal(path.eval()(x), x)


def _repeated_batches(batches=3) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(16, 3, 16, 16, generator=g).repeat(batches, 1, 1, 1)
    return DataLoader(TensorDataset(x, torch.arange(16 * batches) % K), batch_size=16, shuffle=False)


def _outputs(tmp_path, algos, **kwargs):
    outputs: list[torch.Tensor] = []
    rng: list[bool] = []
    probe = Probe(
        before_forward=lambda s: rng.append(torch.get_rng_state()),
        after_forward=lambda s: (
            outputs.append(s.outputs.detach().clone()),
            rng.append(torch.equal(rng.pop(), torch.get_rng_state())),
        ),
    )
    trainer = train(tmp_path, [*algos, probe], **kwargs)
    return outputs, rng, trainer


def test_in_training_batches_of_the_same_inputs_drop_differently_and_off_leaves_the_model(tmp_path):
    # lr 0: the weights stay, so only the drops can tell the equal batches apart.
    common = {"train_data": _repeated_batches(), "max_duration": "3ba", "lr": 0.0, "eval_interval": None}
    on, rng, trainer = _outputs(tmp_path / "on", [sd(drop_rate=0.5)], model=resnet(), **common)
    assert all(not torch.equal(on[0], o) for o in on[1:])
    assert all(rng)  # the global RNG untouched by the forward
    assert trainer.state.summary["stochastic_depth"]["blocks"] == 3
    for name, algos in (("absent", []), ("rate 0", [sd(drop_rate=0.0)])):
        off, _, trainer = _outputs(tmp_path / name, algos, model=resnet(), **common)
        assert all(torch.equal(off[0], o) for o in off[1:]), name
        assert not drop_paths(trainer.state.model), name


def test_a_resumed_run_continues_bit_exactly(tmp_path):
    def run(path, **kwargs):
        return _outputs(path, [sd(drop_rate=0.5)], model=resnet(), eval_interval=None, **kwargs)

    whole, _, straight = run(tmp_path / "whole", max_duration="4ba", checkpoint_interval=None)
    first = run(tmp_path / "half", max_duration="2ba", checkpoint_interval="2ba")[2]
    latest = first.run_dir / "checkpoints" / "latest.pt"
    resumed, _, trainer = run(tmp_path / "half", max_duration="4ba", load_path=latest)
    assert len(resumed) == 2
    assert all(torch.equal(a, b) for a, b in zip(whole[2:], resumed, strict=True))
    for p, q in zip(straight.state.model.parameters(), trainer.state.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_model_it_cannot_change_is_refused_by_name_in_one_line(tmp_path):
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, K))
    with pytest.raises(ConfigError) as info:
        train(tmp_path, [sd()], model=model, max_duration="1ba")
    message = str(info.value)
    assert message.startswith("algorithms.stochastic_depth: cannot change Sequential: it has no residual block")
    assert "\n" not in message


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"drop_rate": 1.0}, "algorithms.stochastic_depth: drop_rate must be a finite number in [0, 1)"),
        ({"drop_rate": -0.1}, "algorithms.stochastic_depth: drop_rate must be a finite number in [0, 1)"),
        ({"rate": 0.1}, "algorithms.stochastic_depth: unknown key 'rate'"),
    ],
)
def test_bad_options_name_the_key(options, message):
    with pytest.raises(ConfigError) as info:
        plugin_config(StochasticDepth, options)
    assert str(info.value).startswith(message)


def test_a_bad_option_on_the_command_line_is_one_line_before_the_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(["train", "-q", "-a", "stochastic_depth", *TINY_RUN, "trainer.max_duration=1ba",
                 "algorithms.stochastic_depth.drop_rate=1.5", f"trainer.run_dir={run_dir}"])
    err = error_lines(capsys.readouterr().err)
    assert code == 2 and len(err) == 1 and "algorithms.stochastic_depth: drop_rate" in err[0], err
    assert not run_dir.exists()


def test_surgery_comes_before_the_plugins_that_wrap_or_copy_the_model():
    order = [a.name for a in resolve_order([EMA(), ActivationCheckpointing(), sd()])]
    assert order.index("stochastic_depth") < min(order.index("ema"), order.index("activation_checkpointing"))
    assert {"ema", "activation_checkpointing", "fsdp", "torch_compile"} <= set(StochasticDepth.runs_before)
