import copy

import pytest
import timm
import torch
import torch.nn.functional as F
from slipstream_image_size_curriculum import ImageSizeCurriculum
from slipstream_locality_ffn import LocalityAct, LocalityFFN, add_locality

from helpers import Probe, tiny_loaders, tiny_model, train
from slipstream import ConfigError, Trainer
from slipstream.plugins.discovery import plugin_config


def small_vit(**kwargs) -> torch.nn.Module:
    """test_vit with 4 px patches: a 4x4 grid at 16 px, 8x8 at 32 px."""
    torch.manual_seed(0)
    options = dict(num_classes=4, img_size=16, patch_size=4, dynamic_img_size=True) | kwargs
    return timm.create_model("test_vit", **options)


def convs(model: torch.nn.Module) -> list[torch.nn.Conv2d]:
    return [m.conv for m in model.modules() if isinstance(m, LocalityAct)]


def test_add_locality_works_at_any_size_with_prefix_tokens():
    for model in (
        small_vit(),
        small_vit(reg_tokens=2),
        small_vit(class_token=False, global_pool="avg"),
    ):
        model.eval()
        x = torch.rand(2, 3, 16, 16)
        shape = model(x).shape
        new = add_locality(model)
        depth = len(model.blocks)
        assert len(new) == 2 * depth and len(convs(model)) == depth
        hidden = model.blocks[0].mlp.fc1.out_features
        assert new[0].shape == (hidden, 1, 3, 3)  # depth-wise
        for size in ((16, 16), (32, 32), (16, 32), (24, 8)):
            assert model(torch.rand(2, 3, *size)).shape == shape
        assert add_locality(model) == []  # already there: nothing added


def test_patch_tokens_are_convolved_on_their_grid_and_prefix_tokens_bypass():
    model = small_vit(reg_tokens=1)  # two prefix tokens
    add_locality(model)
    layer = model.blocks[0].mlp.act
    layer.act = torch.nn.Identity()  # look at the convolution alone
    image = torch.randn(2, 8, 3, 5)  # a non-square 3x5 grid of 8 channels
    layer.conv = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
    layer.grid.size = (3, 5)  # as the patch embedding's pre-hook would record it
    prefix = torch.randn(2, 2, 8)
    tokens = torch.cat((prefix, image.flatten(2).transpose(1, 2)), dim=1)  # timm's token order
    out = layer(tokens)
    expected = F.hardswish(layer.conv(image)).flatten(2).transpose(1, 2)
    assert torch.equal(out[:, :2], prefix)
    torch.testing.assert_close(out[:, 2:], expected)


def test_grid_follows_the_input_and_copies_have_their_own():
    model = small_vit()
    add_locality(model)
    model(torch.rand(1, 3, 16, 32))
    grid = model.blocks[0].mlp.act.grid
    assert grid.size == (4, 8) and all(b.mlp.act.grid is grid for b in model.blocks)
    ema = copy.deepcopy(model)  # what an EMA plugin does
    ema(torch.rand(1, 3, 32, 16))
    assert ema.blocks[0].mlp.act.grid.size == (8, 4) and grid.size == (4, 8)


def test_non_vit_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="locality_ffn needs a timm VisionTransformer"):
        add_locality(tiny_model("resnet"))
    with pytest.raises(ConfigError, match="ResNet is not one"):
        train(tmp_path, [LocalityFFN()], max_duration="1ba")
    with pytest.raises(ConfigError, match="cannot be combined with token dropping"):
        add_locality(small_vit(patch_drop_rate=0.5))


def test_new_parameters_train_in_the_optimizer_groups_of_their_neighbours(tmp_path):
    model = small_vit()
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-2,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    initial = {}
    probe = Probe(
        fit_start=lambda s: initial.update({id(p): p.detach().clone() for p in convs(s.model)[0].parameters()})
    )
    train_data, eval_data = tiny_loaders()
    trainer = Trainer(
        model=model,
        optimizer=optimizer,
        train_data=train_data,
        eval_data=eval_data,
        max_duration="4ba",
        algorithms=[LocalityFFN(), probe],
        schedulers=[scheduler],
        run_dir=tmp_path / "run",
        device="cpu",
        progress_bar=False,
        verbose=False,
        eval_interval=None,
    )
    trainer.fit()
    conv = convs(model)[0]
    groups = optimizer.param_groups
    assert any(p is conv.weight for p in groups[0]["params"])  # decayed, like fc1.weight
    assert any(p is conv.bias for p in groups[1]["params"])  # not decayed, like fc1.bias
    assert len(groups) == 2  # no new group, so the scheduler still covers every parameter
    for p in conv.parameters():
        assert not torch.equal(p.detach(), initial[id(p)])  # they trained
        assert p in optimizer.state
    depth = len(model.blocks)
    assert trainer.summary["locality_ffn_parameters"] == depth * sum(p.numel() for p in conv.parameters())


def test_checkpoint_holds_the_new_weights_and_reloads(tmp_path):
    trainer = train(tmp_path, [LocalityFFN()], model=small_vit(), max_duration="2ba", eval_interval=None)
    checkpoint = trainer.run_dir / "checkpoints" / "latest.pt"
    saved = torch.load(checkpoint, weights_only=True)["model"]
    assert "blocks.0.mlp.act.conv.weight" in saved and "blocks.0.mlp.act.conv.bias" in saved

    fresh = small_vit()
    add_locality(fresh)
    fresh.load_state_dict(saved)  # strict: every key fits
    x = torch.rand(2, 3, 16, 16)
    trained = trainer.state.model.eval()
    torch.testing.assert_close(fresh.eval()(x), trained(x))

    # And the engine resumes it, optimizer state included.
    resumed = train(
        tmp_path,
        [LocalityFFN()],
        model=small_vit(),
        max_duration="3ba",
        load_path=checkpoint,
        eval_interval=None,
    )
    assert resumed.state.timestamp.batch == 3


def test_without_the_plugin_there_is_no_convolution(tmp_path):
    trainer = train(tmp_path, [], model=small_vit(), max_duration="1ba", eval_interval=None)
    assert convs(trainer.state.model) == []
    saved = torch.load(trainer.run_dir / "checkpoints" / "latest.pt", weights_only=True)["model"]
    assert not any("mlp.act" in key for key in saved)


def test_runs_with_an_image_size_curriculum(tmp_path):
    heights = []
    probe = Probe(before_forward=lambda s: heights.append(s.batch[0].shape[-1]))
    model = small_vit()  # 16 px data, patch 4: grids of 2x2, 3x3 and 4x4
    trainer = train(
        tmp_path,
        [ImageSizeCurriculum(), LocalityFFN(), probe],
        model=model,
        max_duration="3ep",
        eval_interval="3ep",  # once, at the end
    )
    assert heights[0] == 8 and heights[-1] == 16 and 12 in heights
    assert len(convs(model)) == len(model.blocks)
    assert trainer.summary["accuracy"] is not None  # evaluated at full size


def test_order_and_options():
    assert {"ema", "torch_compile"} <= set(LocalityFFN.runs_before)
    assert plugin_config(LocalityFFN, {}) is None
    with pytest.raises(ConfigError, match="takes no options"):
        plugin_config(LocalityFFN, {"kernel_size": 5})
