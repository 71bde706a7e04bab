"""blurpool: strided convolutions and max-pools of any CNN blurred in place, shapes and
state_dict keys unchanged, channels-last kept, idempotent; a model with nothing to blur
refused by name; a resumed run bit-exact."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn.functional as F
import torchvision
from slipstream_blurpool import (
    BlurConv2d,
    BlurMaxPool2d,
    BlurPool,
    apply_blurpool,
    blur_2d,
    blur_filter,
    blurmax_pool2d,
    blurred_layers,
)

from helpers import Probe, error_lines, tiny_model
from helpers import train as _train
from slipstream import Algorithm, ConfigError
from slipstream.plugins.discovery import PluginInfo, discover, plugin_config, resolve_order

INSTALLED = discover()  # named in each run: spares a scan of the installed plugins per write


def train(tmp_path, algos, **kwargs):
    known = {a.name: PluginInfo(a.name, "tests", "0", "helpers", cls=type(a)) for a in algos}
    return _train(tmp_path, algos, installed={**known, **INSTALLED}, **kwargs)


def blurpool(**options) -> BlurPool:
    return BlurPool(plugin_config(BlurPool, options))


MODELS = {
    "timm test_resnet": (lambda: timm.create_model("test_resnet", num_classes=4), 4),
    "timm resnet18": (lambda: timm.create_model("resnet18", num_classes=4), 7),
    "torchvision resnet18": (lambda: torchvision.models.resnet18(num_classes=4), 7),
}
RESNET18 = timm.create_model("resnet18", num_classes=4)  # copied where one is needed


# -- the functional API -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["timm test_resnet", "timm resnet18", "torchvision resnet18"])
def test_strided_convs_and_pools_are_blurred_in_place_with_the_same_shapes_and_keys(name):
    make, expected = MODELS[name]
    torch.manual_seed(0)
    model = make().eval()
    params = list(model.parameters())
    keys = {k: v.shape for k, v in model.state_dict().items()}
    strided = sorted(
        n for n, m in model.named_modules()
        if (isinstance(m, torch.nn.Conv2d) and max(m.stride) > 1 and m.in_channels >= 16)
        or (isinstance(m, torch.nn.MaxPool2d) and m.stride > 1)
    )
    xs = [torch.rand(2, 3, 32, 32), torch.rand(1, 3, 64, 48)]
    with torch.no_grad():
        before = [model(x) for x in xs]
    assert apply_blurpool(model) == expected
    assert sorted(blurred_layers(model)) == strided
    assert all(type(m) is BlurMaxPool2d for m in model.modules() if isinstance(m, torch.nn.MaxPool2d))
    # The same parameters (the optimizer needs no surgery), keys and shapes (checkpoints load).
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    assert {k: v.shape for k, v in model.state_dict().items()} == keys
    with torch.no_grad():
        after = [model(x) for x in xs]
    assert all(a.shape == b.shape and not torch.allclose(a, b) for a, b in zip(before, after, strict=True))
    # Idempotent: a second call changes nothing.
    assert apply_blurpool(model) == 0
    with torch.no_grad():
        assert all(torch.equal(model(x), a) for x, a in zip(xs, after, strict=True))


def test_the_blur_is_a_normalised_low_pass_and_pools_keep_their_shape():
    filt = blur_filter(3)
    assert filt.shape == (3, 1, 3, 3) and torch.allclose(filt.sum((1, 2, 3)), torch.ones(3))
    assert torch.equal(filt[0, 0, 1], torch.tensor([2.0, 4.0, 2.0]) / 16)
    flat = torch.full((1, 3, 8, 8), 0.5)
    assert torch.allclose(blur_2d(flat)[..., 1:-1, 1:-1], flat[..., 1:-1, 1:-1])  # flat stays flat inside
    checker = (torch.arange(64.0).reshape(8, 8) % 2)[None, None].expand(1, 2, 8, 8)
    assert blur_2d(checker)[..., 2:-2, 2:-2].std() < 0.5 * checker.std()  # high frequencies damped
    for size in (5, 7, 8, 15, 16):
        x = torch.rand(1, 4, size, size + 1)
        for k, s, p in ((3, 2, 1), (2, 2, 0), (3, 3, 0)):
            assert blurmax_pool2d(x, k, s, p).shape == F.max_pool2d(x, k, s, p).shape


def test_options_choose_what_is_replaced():
    def count(**options):
        model = copy.deepcopy(RESNET18)
        n = apply_blurpool(model, **options)
        return n, {type(m).__name__ for m in model.modules() if "Blur" in type(m).__name__}

    assert count(replace_maxpools=False) == (6, {"BlurConv2d"})
    assert count(replace_convs=False) == (1, {"BlurMaxPool2d"})
    assert count(min_channels=0)[0] == 8  # the RGB stem too
    assert count(min_channels=512)[0] == 1  # no conv has 512 input channels
    with pytest.raises(ValueError, match=r"min_channels must be a whole number >= 0"):
        apply_blurpool(timm.create_model("test_resnet"), min_channels=-1)


def test_channels_last_stays_channels_last_with_the_same_values():
    torch.manual_seed(0)
    model = timm.create_model("test_resnet", num_classes=4).eval()
    apply_blurpool(model)
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        plain = model(x)
        model.to(memory_format=torch.channels_last)
        xl = x.contiguous(memory_format=torch.channels_last)
        for layer in (model.maxpool, model.layer2[0].conv1):
            assert isinstance(layer, (BlurConv2d, BlurMaxPool2d))
            probe = torch.rand(2, 32, 9, 9).contiguous(memory_format=torch.channels_last)
            assert layer(probe).is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(model(xl), plain, rtol=1e-4, atol=1e-5)


def test_copies_keep_the_blur_and_it_follows_dtype_and_device():
    model = tiny_model()
    apply_blurpool(model)
    ema = copy.deepcopy(model)  # what an EMA plugin does
    assert blurred_layers(ema) == blurred_layers(model)
    conv = ema.layer2[0].conv1
    assert conv.blur_filter is not model.layer2[0].conv1.blur_filter
    ema.to(torch.float64).eval()
    assert conv.blur_filter.dtype == torch.float64
    assert ema(torch.rand(1, 3, 16, 16, dtype=torch.float64)).dtype == torch.float64
    assert "blur_filter" not in "".join(model.state_dict())  # not saved: a constant


# -- in training ------------------------------------------------------------------------


def test_a_run_blurs_the_model_and_off_leaves_it(tmp_path):
    seen = {}
    probe = Probe(fit_start=lambda s: seen.setdefault("layers", blurred_layers(s.unwrapped_model)))
    quick = {"max_duration": "1ba", "eval_interval": None, "checkpoint_interval": None}
    on = train(tmp_path / "on", [blurpool(), probe], **quick)
    assert seen["layers"] == ["maxpool", "layer2.0.conv1", "layer3.0.conv2", "layer4.0.conv1"]
    assert on.summary["blurpool"] == {"layers": 4, "replaced": 4}
    off = train(tmp_path / "off", [], **quick)
    assert not blurred_layers(off.state.unwrapped_model)


def test_a_model_with_nothing_to_blur_is_refused_by_name(tmp_path, capsys):
    vit = tiny_model("vit")
    with pytest.raises(ConfigError) as info:
        train(tmp_path, [blurpool()], model=vit, max_duration="1ba")
    message = str(info.value)
    assert len(error_lines(message)) == 1
    assert message.startswith("blurpool cannot change VisionTransformer: it has no strided Conv2d")
    assert apply_blurpool(tiny_model("vit")) == 0  # the functional API just counts


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"min_channels": -1}, r"min_channels must be a whole number >= 0"),
        ({"min_channels": 1.5}, r"min_channels"),
        ({"replace_convs": "sometimes"}, r"replace_convs"),
        ({"replace_convs": False, "replace_maxpools": False}, r"both false: nothing would be blurred"),
        ({"blur_first": False}, r"allowed keys: replace_convs, replace_maxpools, min_channels"),
    ],
)
def test_bad_options_are_one_line_naming_the_key(options, message):
    with pytest.raises(ConfigError, match=message) as info:
        plugin_config(BlurPool, options)
    assert "algorithms.blurpool" in str(info.value) and len(error_lines(str(info.value))) == 1


def test_a_resumed_run_is_bit_exact_and_its_checkpoint_loads_without_blurpool(tmp_path):
    whole = train(tmp_path / "whole", [blurpool()], max_duration="6ba", eval_interval=None)
    first = train(tmp_path / "half", [blurpool()], max_duration="1ep", eval_interval=None)
    latest = first.run_dir / "checkpoints" / "latest.pt"
    resumed = train(tmp_path / "half", [blurpool()], max_duration="6ba", load_path=latest, eval_interval=None)
    assert resumed.summary["batches"] == 6
    a, b = whole.state.unwrapped_model.state_dict(), resumed.state.unwrapped_model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    plain = tiny_model()
    plain.load_state_dict(torch.load(latest, weights_only=True)["model"])  # same keys, no filter


def test_surgery_comes_before_copies_wrappers_and_compilation():
    others = ["ema", "channels_last", "activation_checkpointing", "fsdp", "torch_compile", "locality_ffn"]
    stand_ins = [type(n, (Algorithm,), {"name": n})() for n in others]
    order = [a.name for a in resolve_order([*stand_ins, BlurPool()])]
    assert all(order.index("blurpool") < order.index(n) for n in others[:5])
