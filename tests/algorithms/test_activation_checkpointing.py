"""Activation checkpointing: same gradients, fewer saved activations, same state_dict keys."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from slipstream_activation_checkpointing import (
    ActivationCheckpointing,
    apply_activation_checkpointing,
    checkpointed_modules,
    find_repeated_blocks,
    resolve_modules,
)
from torch import nn

from helpers import Probe, tiny_model, train
from slipstream import ConfigError, Duration, State
from slipstream.plugins.discovery import plugin_config


class Block(nn.Module):
    """A residual conv block with BatchNorm (whose statistics recomputation must not
    update twice) and an in-place ReLU."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.bn(self.conv(x)))


def sequential_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), Block(), Block(), Block(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )


def resnet18() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=4)


class SavedBytes:
    """Bytes of activations autograd saves for backward (weights excluded), measured with
    saved_tensors_hooks: with checkpointing only the blocks' inputs are saved."""

    def __init__(self, model: nn.Module) -> None:
        self.weights = {p.data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in self.weights:
            storage = t.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def forward_backward(model: nn.Module, x: torch.Tensor) -> int:
    meter = SavedBytes(model)
    with meter.hooks:
        out = model(x)
    out.float().sum().backward()
    return meter.total


def compare(reference: nn.Module, checkpointed: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """Train-mode forward/backward on both; gradients and buffers must agree."""
    off, on = forward_backward(reference, x), forward_backward(checkpointed, x)
    for (name, p), q in zip(reference.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    for (name, a), b in zip(reference.named_buffers(), checkpointed.buffers(), strict=True):
        torch.testing.assert_close(b, a, msg=name)  # BatchNorm statistics updated once
    return off, on


# -- the pure function (plain torch path) ---------------------------------------------------


@pytest.mark.parametrize(
    "build, size, expected",
    [
        (resnet18, 32, [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]),
        (sequential_model, 8, ["2", "3", "4"]),
    ],
)
def test_same_gradients_fewer_saved_activations_same_keys(build, size, expected):
    reference, model = build(), build()
    keys = list(model.state_dict())
    assert apply_activation_checkpointing(model) == expected
    assert checkpointed_modules(model) == expected
    assert list(model.state_dict()) == keys  # checkpoints keep the same keys
    model.load_state_dict(reference.state_dict())  # and load both ways

    torch.manual_seed(1)
    off, on = compare(reference, model, torch.rand(2, 3, size, size))
    assert on < 0.6 * off, (on, off)


def test_without_checkpointing_the_saved_activations_are_the_same():
    # The measure itself: two untouched copies save the same.
    a, b = sequential_model(), sequential_model()
    x = torch.rand(2, 3, 8, 8)
    assert forward_backward(a, x) == forward_backward(b, x) > 0


def test_evaluation_runs_the_plain_forward():
    reference, model = resnet18().eval(), resnet18().eval()
    apply_activation_checkpointing(model)
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x))


def test_modules_by_path_and_class_name():
    model = resnet18()
    assert resolve_modules(model, ["layer1", "layer2.1"]) == ["layer1.0", "layer1.1", "layer2.1"]
    assert resolve_modules(model, ["BasicBlock"]) == find_repeated_blocks(model)
    # Each module once, in the model's order; nothing inside an already chosen one.
    assert resolve_modules(model, ["layer3", "BasicBlock"]) == find_repeated_blocks(model)
    assert resolve_modules(model, ["layer4", "layer4.0.conv1"]) == ["layer4.0", "layer4.1"]
    assert resolve_modules(sequential_model(), ["Block"]) == ["2", "3", "4"]
    assert apply_activation_checkpointing(model, ["fc"]) == ["fc"]


def test_unknown_module_lists_what_exists():
    listing = r"'layer9'.*children of ResNet are: conv1, bn1, .*layer4, avgpool, fc"
    with pytest.raises(ValueError, match=listing):
        apply_activation_checkpointing(resnet18(), ["layer9"])
    with pytest.raises(ValueError, match=r"'layer1.7'.*children of 'layer1' are: 0, 1"):
        apply_activation_checkpointing(resnet18(), ["layer1.7"])
    with pytest.raises(ValueError, match="found no repeated blocks.*children are: 0, 1"):
        apply_activation_checkpointing(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))


def test_a_deep_copy_is_checkpointed_on_its_own_weights():
    # The EMA plugin deep-copies the model: the copy must run its own forward.
    model = sequential_model()
    apply_activation_checkpointing(model)
    twin = copy.deepcopy(model)
    assert checkpointed_modules(twin) == ["2", "3", "4"]
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    x = torch.rand(1, 3, 8, 8)
    twin(x).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    assert apply_activation_checkpointing(model) == ["2", "3", "4"]  # idempotent


# -- the plugin --------------------------------------------------------------------------------


def bare_state(model: nn.Module) -> State:
    return State(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                 max_duration=Duration.parse("1ep"))


def plugin(**options) -> ActivationCheckpointing:
    return ActivationCheckpointing(plugin_config(ActivationCheckpointing, options))


def test_timm_path_same_gradients_fewer_saved_activations():
    reference, model = tiny_model("vit"), tiny_model("vit")
    algo = plugin()
    algo.init(bare_state(model))
    assert algo.path == "timm" and model.grad_checkpointing and not checkpointed_modules(model)
    off, on = compare(reference, model, torch.rand(4, 3, 16, 16))
    assert on < 0.6 * off, (on, off)


def test_modules_mode_on_a_timm_model():
    reference, model = tiny_model("vit"), tiny_model("vit")
    algo = plugin(mode="modules")
    algo.init(bare_state(model))
    assert algo.path == "modules" and not model.grad_checkpointing
    assert algo.wrapped == [f"blocks.{i}" for i in range(len(model.blocks))]
    off, on = compare(reference, model, torch.rand(4, 3, 16, 16))
    assert on < 0.6 * off


class Meter(Probe):
    """Measures the activations saved by the engine's training forward."""

    def __init__(self) -> None:
        super().__init__(before_forward=self.enter, after_forward=self.leave)
        self.totals: list[int] = []

    def enter(self, state):
        self.meter = SavedBytes(state.model)
        self.meter.hooks.__enter__()

    def leave(self, state):
        self.meter.hooks.__exit__(None, None, None)
        if state.training:
            self.totals.append(self.meter.total)


@pytest.mark.parametrize("kind, path", [("vit", "timm"), ("resnet", "timm"), ("resnet", "modules")])
def test_in_a_run_the_training_forward_saves_less(tmp_path, kind, path):
    runs = {}
    for on in (False, True):
        meter = Meter()
        algos = [plugin(mode="auto" if path == "timm" else "modules"), meter] if on else [meter]
        trainer = train(tmp_path / str(on), algos, model=tiny_model(kind), max_duration="1ba",
                        eval_interval=None, checkpoint_interval=None)
        runs[on] = (meter.totals[-1], trainer.summary)
    # test_resnet's full-resolution stem is outside the blocks, so it saves less there.
    assert runs[True][0] < (0.6 if kind == "vit" else 0.8) * runs[False][0], runs
    assert runs[True][1]["activation_checkpointing"]["path"] == path
    assert "activation_checkpointing" not in runs[False][1]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"mode": "always"}, "mode must be one of auto, timm, modules, got 'always'"),
        ({"mode": "timm", "modules": ["blocks"]}, "modules cannot be combined with mode 'timm'"),
        ({"modules": []}, "modules must be a non-empty list"),
        ({"modules": "blocks"}, "algorithms.activation_checkpointing.modules"),
    ],
)
def test_config_errors_name_the_key_and_what_is_allowed(options, message):
    with pytest.raises(ConfigError, match=message) as info:
        plugin_config(ActivationCheckpointing, options)
    assert "algorithms.activation_checkpointing" in str(info.value)


def test_errors_at_init_name_the_key_and_what_exists():
    listing = r"activation_checkpointing.modules: 'layer9'.*children of ResNet"
    with pytest.raises(ConfigError, match=listing):
        plugin(modules=["layer9"]).init(bare_state(resnet18()))
    with pytest.raises(ConfigError, match=r"mode: 'timm' needs a model with set_grad_check"):
        plugin(mode="timm").init(bare_state(resnet18()))


def test_declared_order():
    assert ActivationCheckpointing.runs_after == ("locality_ffn",)
    assert ActivationCheckpointing.runs_before == ("torch_compile",)


def test_under_fsdp_blocks_are_checkpointed_one_by_one_and_timm_mode_is_refused():
    # timm checkpoints a ResNet's stages as one sequence, whose recompute crashed under
    # FSDP2 (compatibility matrix); auto checkpoints each block instead.
    from types import SimpleNamespace

    import timm
    from slipstream_activation_checkpointing import ActivationCheckpointing, ActivationCheckpointingConfig

    from slipstream import ConfigError

    fsdp = SimpleNamespace(name="fsdp")
    model = timm.create_model("test_resnet", num_classes=4)
    state = SimpleNamespace(unwrapped_model=model, algorithms=[fsdp], summary={})
    plugin = ActivationCheckpointing(ActivationCheckpointingConfig())
    plugin.init(state)
    assert plugin.path == "modules" and plugin.wrapped
    with pytest.raises(ConfigError, match=r"mode=timm cannot run with fsdp.*use mode auto or modules"):
        ActivationCheckpointing(ActivationCheckpointingConfig(mode="timm")).init(
            SimpleNamespace(unwrapped_model=timm.create_model("test_resnet"), algorithms=[fsdp], summary={})
        )
