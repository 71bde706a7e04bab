"""gpu_augmentation's timm stages: RandAugment strings (per-image operations,
magnitude noise, timm's operations and arguments) and random erasing (its three
fills, on the normalised batch); bad options refused up front; exact resume."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image
from slipstream_gpu_augmentation import (
    Erasing,
    GpuAugmentation,
    parse_rand_augment,
    rand_augment,
    random_erase,
)
from slipstream_gpu_augmentation.erasing import draw_boxes
from slipstream_gpu_augmentation.randaugment import (
    GEOMETRIC_OPS,
    PIXEL_OPS,
    _pixel_matrices,
    _to_theta,
    _warp,
    draw_plan,
    level_arg,
)
from timm.data import auto_augment as timm_aa
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import Probe, tiny_loaders
from helpers import train as _train
from slipstream import ConfigError, State, Timestamp
from slipstream.plugins.discovery import PluginInfo, discover, plugin_config

INSTALLED = discover()
RAW_TRAIN = torch.cat([x for x, _ in tiny_loaders()[0]])
STATS = ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))


def aug(**options) -> GpuAugmentation:
    return GpuAugmentation(plugin_config(GpuAugmentation, options))


def model_inputs(tmp_path, algos, **kwargs) -> list[torch.Tensor]:
    """The batches the model received (after every before_forward)."""
    seen: list[torch.Tensor] = []
    probe = Probe(after_forward=lambda s: seen.append(s.batch[0].clone()))
    kwargs.setdefault("eval_interval", None)
    known = {a.name: PluginInfo(a.name, "tests", "0", "helpers", cls=type(a)) for a in [*algos, probe]}
    _train(tmp_path, [*algos, probe], installed={**known, **INSTALLED}, **kwargs)
    return seen


# -- RandAugment ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text", ["rand-m9-mstd0.5-inc1", "rand-m6-mstd0.5-inc1", "rand-m7-n3-p0.8", "rand-mstd101-tweights"]
)
def test_strings_parse_as_timm_reads_them(text):
    ours = parse_rand_augment(text)
    theirs = timm_aa.rand_augment_transform(text, {})
    assert ours.ops == tuple(op.name for op in theirs.ops)
    assert ours.num_layers == theirs.num_layers
    assert {(ours.prob, ours.magnitude, ours.magnitude_std)} == {
        (op.prob, op.magnitude, op.magnitude_std) for op in theirs.ops
    }
    if theirs.choice_weights is not None:
        np.testing.assert_allclose(np.array(ours.weights) / sum(ours.weights), theirs.choice_weights)


@pytest.mark.parametrize(
    "text, section",
    [
        ("rand-m9-mstd0.5-inc2", "'inc2' needs 0 or 1"),
        ("rand-m9.5", "'m9.5' needs an int >= 0"),
        ("rand-n0", "'n0' needs an int >= 1"),
        ("rand-p1.5", r"'p1.5' needs a number in \[0, 1\]"),
        ("rand-mstd-1", "'mstd' needs a number >= 0"),
        ("rand-m9-m8", "'m8' is given twice"),
        ("rand-m9-w0", "'w0' is timm's removed weight index; timm >= 1.0 takes -tweights"),
        ("rand-tfoo", "'tfoo' names no transform set"),
        ("rand-x3", "'x3' is unknown"),
        ("rand-n20-tweights", "'n20' asks for more operations than the 15 of -tweights"),
        ("augmix-m9", "must start with 'rand', got 'augmix'"),
    ],
)
def test_bad_strings_are_refused_naming_the_section_and_the_grammar(text, section):
    with pytest.raises(ConfigError, match=section) as info:
        plugin_config(GpuAugmentation, {"rand_augment": text})
    message = str(info.value)
    assert message.startswith("algorithms.gpu_augmentation: rand_augment")
    assert "grammar: rand[-m<int>]" in message and "\n" not in message


def test_each_image_draws_its_own_operations():
    same = torch.rand(1, 3, 16, 16).expand(16, -1, -1, -1).contiguous()
    out = rand_augment(same, "rand-m9-mstd0.5-inc1", seed=0)
    assert out.shape == same.shape and 0 <= out.min() and out.max() <= 1
    assert len({tuple(o.flatten().tolist()) for o in out}) > 8  # not one transform for the batch
    plan = draw_plan(parse_rand_augment("rand-m9-mstd0.5-inc1"), 16, torch.Generator().manual_seed(0))
    assert len(set(plan.ops[:, 0].tolist())) > 4
    # Same seed, same result; the global RNG is neither used nor moved.
    rng = torch.get_rng_state()
    assert torch.equal(out, rand_augment(same, "rand-m9-mstd0.5-inc1", seed=0))
    assert torch.equal(torch.get_rng_state(), rng)
    assert not torch.equal(out, rand_augment(same, "rand-m9-mstd0.5-inc1", seed=1))
    # The geometric operations' resampling changes those images only, and no draw.
    spec = parse_rand_augment("rand-m9-n1-p1.0")
    plan = draw_plan(spec, 16, torch.Generator().manual_seed(0))
    warped = torch.tensor([spec.ops[k] in GEOMETRIC_OPS for k in plan.ops[:, 0].tolist()])
    linear, cubic = (rand_augment(same, spec, seed=0, interpolation=mode) for mode in ("bilinear", "bicubic"))
    assert warped.any() and torch.equal(linear[~warped], cubic[~warped])
    assert all(not torch.equal(a, b) for a, b in zip(linear[warped], cubic[warped], strict=True))
    # p0: no operation is applied.
    assert torch.equal(rand_augment(same, "rand-m9-mstd0.5-inc1-p0", seed=0), same)


def test_magnitude_noise_per_application_clipped_to_0_10():
    g = torch.Generator().manual_seed(0)
    assert (draw_plan(parse_rand_augment("rand-m9-inc1"), 500, g).magnitude == 9).all()
    noisy = draw_plan(parse_rand_augment("rand-m9-mstd0.5-inc1"), 2000, g).magnitude
    assert 0.45 < noisy.std() < 0.55 and abs(noisy.mean() - 9) < 0.05
    top = draw_plan(parse_rand_augment("rand-m10-mstd1"), 2000, g).magnitude
    assert top.max() == 10 and (top == 10).float().mean() > 0.4  # clipped at _LEVEL_DENOM
    uniform = draw_plan(parse_rand_augment("rand-m9-mstd101"), 2000, g).magnitude
    assert 0 <= uniform.min() < 0.1 and 8.9 < uniform.max() <= 9

    # Visible: images that drew SolarizeIncreasing all get one threshold without noise, not with it.
    same = torch.rand(1, 3, 16, 16).expand(64, -1, -1, -1).contiguous()
    for text, noisy in (("rand-m5-n1-p1.0-inc1", False), ("rand-m5-n1-p1.0-mstd2-inc1", True)):
        spec = parse_rand_augment(text)
        plan = draw_plan(spec, 64, torch.Generator().manual_seed(3))
        rows = (plan.ops[:, 0] == spec.ops.index("SolarizeIncreasing")).nonzero().flatten()
        assert len(rows) >= 3
        out = rand_augment(same, spec, seed=3)[rows]
        distinct = len({tuple(o.flatten().tolist()) for o in out})
        assert distinct > 1 if noisy else distinct == 1


def test_the_plugin_stage_after_the_preset_and_p0_removes_it():
    x = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8)
    state = State.__new__(State)
    state.seed, state.rank, state.timestamp = 0, 0, Timestamp()

    def batch_start(**options) -> torch.Tensor:
        state.batch = (x, None)
        aug(**options).batch_start(state)
        return state.batch[0]

    light = batch_start()
    on = batch_start(rand_augment="rand-m9-mstd0.5-inc1")
    off = batch_start(rand_augment="rand-m9-mstd0.5-inc1-p0")
    assert on.dtype == torch.float32 and on.shape == x.shape and 0 <= on.min() and on.max() <= 1
    assert not torch.equal(on, light) and torch.equal(off, light)  # its own stream: the crops stay
    alone = batch_start(preset="none", rand_augment="rand-m9-mstd0.5-inc1")
    assert not torch.equal(alone, x / 255)
    assert torch.equal(batch_start(preset="none", rand_augment="rand-m9-p0"), x / 255)


class _DataDependent(TorchDispatchMode):
    """Records the ops whose result depends on tensor values read by the host (on a
    GPU, each waits for the device): ``.item()``-like reads and ``nonzero``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
            self.seen.append((func.__name__, tuple(args[0].shape)))
        return func(*args, **(kwargs or {}))


def test_no_value_of_the_batch_is_read_on_the_host():
    """Every draw is made on the host: the only data-dependent op is grouping the images
    by the host's draws (nonzero of a mask with one entry per image), never a read of
    the batch, so on a GPU neither stage waits for the device."""
    x = torch.rand(32, 3, 16, 16)
    with _DataDependent() as mode:
        for text in ("rand-m9-n4-p1.0-mstd0.5-inc1", "rand-m9-n3-p1.0", "rand-n3-p1.0-t3aw"):
            rand_augment(x, text, seed=0)
        random_erase(x, Erasing(probability=1.0, count=(1, 3), mode="pixel"), seed=0)
    assert mode.seen and set(mode.seen) == {("nonzero.default", (32,))}


def _timm_op(name: str, image: torch.Tensor, magnitude: float, resample: int = Image.BILINEAR) -> torch.Tensor:
    """timm's operation on a PIL image, its sign drawn after random.seed(0)."""
    pil = Image.fromarray(image.permute(1, 2, 0).numpy())
    hparams = dict(timm_aa._HPARAMS_DEFAULT, interpolation=resample)
    random.seed(0)
    level = timm_aa.LEVEL_TO_ARG[name]
    args = level(magnitude, hparams) if level else ()
    out = timm_aa.NAME_TO_OP[name](pil, *args, fillcolor=(128, 128, 128), resample=resample)
    return torch.from_numpy(np.array(out)).permute(2, 0, 1).float()


EXACT = {"Equalize", "Invert", "Posterize", "PosterizeIncreasing", "Solarize", "SolarizeIncreasing", "SolarizeAdd"}


@pytest.mark.parametrize("magnitude", [3.0, 9.0])
def test_every_operation_is_timms_within_its_stated_tolerance(magnitude):
    image = torch.randint(0, 256, (3, 20, 24), dtype=torch.uint8)
    x = image.float().unsqueeze(0) / 255
    random.seed(0)
    sign = -1.0 if random.random() > 0.5 else 1.0  # what timm's _randomly_negate draws after seed(0)
    for name in [*PIXEL_OPS, *GEOMETRIC_OPS]:
        ref = _timm_op(name, image, magnitude)
        arg = level_arg(name, torch.tensor([magnitude], dtype=torch.float64), torch.tensor([sign], dtype=torch.float64))
        if name in GEOMETRIC_OPS:
            theta = _to_theta(_pixel_matrices(name, arg, 20, 24), 20, 24).float()
            out = _warp(x, theta, torch.full((1, 3, 1, 1), 128 / 255)).clamp(0, 1)
            cubic = _warp(x, theta, torch.full((1, 3, 1, 1), 128 / 255), "bicubic").clamp(0, 1)
            # torch's bicubic kernel (a = -0.75) is not PIL's (a = -0.5): on noise, a few levels.
            assert (cubic[0] * 255 - _timm_op(name, image, magnitude, Image.BICUBIC)).abs().mean() < 6, name
        else:
            out = PIXEL_OPS[name](x.clone(), None if arg is None else arg.float())
        diff = (out[0] * 255 - ref).abs()
        if name in EXACT:  # the same 8-bit levels, but for float rounding
            assert diff.max() < 1e-3, name
        elif name == "GaussianBlur":  # PIL approximates the Gaussian with box blurs
            assert diff.mean() < 5, name
        elif name in GEOMETRIC_OPS:  # bilinear on noise: the border and rounding differ
            assert diff.mean() < 2, name
        else:
            assert diff.max() <= 1.5, name  # float, not rounded to 8-bit levels


# -- random erasing -------------------------------------------------------------------


def test_erasing_modes_fill_their_boxes_with_their_kind_of_values():
    x = torch.full((64, 3, 24, 24), 7.0)  # a value no fill produces
    for mode in ("const", "rand", "pixel"):
        out = random_erase(x, Erasing(probability=1.0, mode=mode), seed=0)
        erased = out != 7
        per_image = erased.flatten(1).any(1)
        assert per_image.float().mean() > 0.9  # a box that fits is found for nearly every image
        assert torch.equal(x, torch.full_like(x, 7.0))  # the input is not modified
        area = erased[:, 0].flatten(1).float().mean(1)[per_image]
        assert area.min() >= 0.01 and area.max() <= 0.4
        values = out[erased].view(-1)
        if mode == "const":
            assert (values == 0).all()
        else:
            assert abs(values.mean()) < 0.2 and 0.8 < values.std() < 1.2  # standard normal
            box = out[per_image.nonzero()[0, 0]]
            inside = box[:, erased[per_image.nonzero()[0, 0], 0]]  # (C, pixels of the box)
            if mode == "rand":  # one colour per box and channel
                assert (inside == inside[:, :1]).all() and inside[:, 0].unique().numel() == 3
            else:
                assert inside.unique().numel() == inside.numel()
    # probability 0: nothing erased; count [2, 3]: several boxes per image.
    assert torch.equal(random_erase(x, Erasing(probability=0.0), seed=0), x)
    boxes = draw_boxes(Erasing(probability=1.0, count=(2, 3)), x.shape, torch.Generator().manual_seed(0))
    assert len(boxes.slots) == 3 and 0 < len(boxes.slots[2][0]) < len(boxes.slots[0][0])


@pytest.mark.parametrize(
    "erasing, message",
    [
        ({"mode": "noise"}, r"erasing.mode must be one of const, rand, pixel, got 'noise'"),
        ({"probabilty": 0.25}, r"erasing: unknown key 'probabilty'; allowed keys: probability, mode, count"),
        ({"count": [3, 1]}, r"erasing.count must be a whole number >= 1 or \[min, max\]"),
        ({"count": 0}, r"erasing.count must be"),
        ({"probability": 1.5}, r"erasing.probability must be a number in \[0, 1\]"),
        ({"min_area": 0.5, "max_area": 0.2}, r"erasing.max_area must be a number in \[min_area, 1\]"),
    ],
)
def test_bad_erasing_options_are_refused(erasing, message):
    with pytest.raises(ConfigError, match=message):
        plugin_config(GpuAugmentation, {"erasing": erasing})


def test_a_bad_interpolation_is_refused():
    with pytest.raises(ConfigError, match="rand_augment_interpolation must be one of random, bilinear, bicubic"):
        plugin_config(GpuAugmentation, {"rand_augment": "rand-m9", "rand_augment_interpolation": "nearest"})


def test_erasing_works_on_the_normalised_batch_and_probability_0_removes_it(tmp_path):
    normalised = [(x - 0.5) / 0.25 for x in RAW_TRAIN.split(16)]
    plugin = aug(preset="none", erasing={"probability": 1.0})
    erased = model_inputs(tmp_path, [plugin], max_duration="2ba", normalize=STATS)
    for got, want in zip(erased, normalised[:2], strict=True):
        box = got != want
        assert box.any(1).flatten(1).any(1).all()  # every image has its box
        assert (got[box] == 0).all()  # zeros once normalised: the mean colour, as timm's const mode
    # Probability 0: the plugin leaves the batch it gets at before_forward as it is.
    plugin = aug(preset="none", erasing={"probability": 0.0, "mode": "pixel"})
    state = State.__new__(State)
    state.batch, state.seed, state.rank, state.timestamp = (normalised[0], None), 0, 0, Timestamp()
    plugin.before_forward(state)
    assert state.batch[0] is normalised[0]


def test_a_resumed_run_continues_the_same_rand_augment_and_erasing(tmp_path):
    options = {"rand_augment": "rand-m9-mstd0.5-inc1", "erasing": {"probability": 0.5, "mode": "pixel"}}
    whole = model_inputs(tmp_path / "whole", [aug(**options)], max_duration="5ba")
    first = _train(tmp_path / "half", [aug(**options)], installed=INSTALLED, max_duration="1ep", eval_interval=None)
    latest = first.run_dir / "checkpoints" / "latest.pt"
    resumed = model_inputs(tmp_path / "half", [aug(**options)], max_duration="5ba", load_path=latest)
    assert len(resumed) == 1 and torch.equal(whole[4], resumed[0])
    assert not torch.equal(whole[0], whole[4])  # the same images, the next epoch: new draws
