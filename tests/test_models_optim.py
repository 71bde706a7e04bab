"""Models by name and optimizers with their implementation chosen for speed."""

import pytest
import torch

from slipstream import ConfigError
from slipstream.models import build_model
from slipstream.optim import build_optimizer


def test_timm_and_torchvision_models_by_name():
    timm_model = build_model("test_resnet", 7)
    assert timm_model(torch.rand(2, 3, 16, 16)).shape == (2, 7)
    tv_model = build_model("torchvision/resnet18", 5)
    assert type(tv_model).__module__.startswith("torchvision")
    assert tv_model.fc.out_features == 5


def test_cifar_stem_keeps_resolution():
    model = build_model("resnet18", 10, cifar_stem=True)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, torch.nn.Identity)
    feats = model.forward_features(torch.rand(1, 3, 32, 32))
    assert feats.shape[-1] == 4  # 32 / 8: only the three stage strides remain


def test_timm_vits_take_any_image_size():
    model = build_model("test_vit", 3, image_size=32)
    assert model.dynamic_img_size
    for size in (16, 32, 48):
        assert model(torch.rand(1, 3, size, size)).shape == (1, 3)


def test_unknown_model_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"unknown model 'resnet_18' \(did you mean"):
        build_model("resnet_18", 10)
    with pytest.raises(ConfigError, match="prefix must be"):
        build_model("keras/resnet18", 10)


def test_optimizer_default_impl_is_fused_on_cpu():
    model = torch.nn.Linear(4, 2)
    for name in ("sgd", "adamw"):
        opt = build_optimizer(model, name, 0.1)
        assert opt.defaults["fused"] is True, name


@pytest.mark.parametrize("impl,fused,foreach", [("for_loop", None, False), ("foreach", None, True)])
def test_optimizer_impl_is_configurable(impl, fused, foreach):
    opt = build_optimizer(torch.nn.Linear(4, 2), "sgd", 0.1, impl=impl)
    assert opt.defaults.get("fused") in (fused, False) and opt.defaults["foreach"] is foreach


def test_adafactor_and_no_decay_for_biases():
    model = torch.nn.Linear(4, 2)
    opt = build_optimizer(model, "adafactor", 0.01, weight_decay=0.1)
    assert type(opt).__name__ == "Adafactor"
    decays = sorted(g["weight_decay"] for g in opt.param_groups)
    assert decays == [0.0, 0.1]


def test_lamb_and_sgdw_are_timms_with_the_runs_settings():
    """The published recipes' optimizers (ResNet strikes back's LAMB, Composer's
    decoupled SGD): timm's classes, given betas/eps or momentum/nesterov."""
    model = torch.nn.Linear(4, 2)
    lamb = build_optimizer(model, "lamb", 8e-3, weight_decay=0.02, betas=(0.9, 0.99), eps=1e-7)
    assert type(lamb).__name__ == "Lamb" and lamb.defaults["betas"] == (0.9, 0.99) and lamb.defaults["eps"] == 1e-7
    sgdw = build_optimizer(model, "sgdw", 2.0, weight_decay=1e-4, momentum=0.875)
    assert type(sgdw).__name__ == "SGDW" and sgdw.defaults["momentum"] == 0.875
    # Decoupled: with no gradient, a step only multiplies the weights by 1 - lr x wd.
    before = model.weight.detach().clone()
    model.weight.grad = torch.zeros_like(model.weight)
    model.bias.grad = torch.zeros_like(model.bias)
    sgdw.step()
    assert torch.allclose(model.weight, before * (1 - 2.0 * 1e-4))


def test_optimizer_errors():
    with pytest.raises(
        ConfigError,
        match="optimizer.name 'lars' is not supported; choose one of sgd, adamw, adafactor, lamb, sgdw",
    ):
        build_optimizer(torch.nn.Linear(2, 2), "lars", 0.1)
    with pytest.raises(ConfigError, match="optimizer.impl=fused: Adafactor has no fused"):
        build_optimizer(torch.nn.Linear(2, 2), "adafactor", 0.1, impl="fused")
    with pytest.raises(ConfigError, match="optimizer.impl 'fast'"):
        build_optimizer(torch.nn.Linear(2, 2), "sgd", 0.1, impl="fast")


def test_a_vits_position_embedding_and_class_token_get_no_weight_decay_as_in_timm():
    """timm's ViT lists them in no_weight_decay(); its recipes (and our layer_decay path)
    leave them undecayed, and so does the default grouping."""
    model = build_model("test_vit", num_classes=4, image_size=32)
    skip = set(model.no_weight_decay())
    assert {"pos_embed", "cls_token"} <= skip
    opt = build_optimizer(model, "adamw", 1e-3, weight_decay=0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    undecayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert skip & set(names.values()) <= undecayed
    decayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0.05 for p in g["params"]}
    assert decayed and all(model.get_parameter(n).ndim > 1 for n in decayed) and not decayed & skip
