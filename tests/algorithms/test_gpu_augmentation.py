"""gpu_augmentation: training batches are augmented per sample, reproducibly, at any
size; evaluation batches and the global RNG are left alone; bad recipes fail early."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from slipstream_gpu_augmentation import (
    GpuAugmentation,
    GpuAugmentationConfig,
    augment_batch,
    batch_seed,
    build_augmentation,
    moved_tensors,
    place_pipeline,
)
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import Probe, tiny_loaders
from helpers import train as _train
from slipstream import Algorithm, ConfigError, Duration, State
from slipstream.plugins.discovery import PluginInfo, discover, plugin_config, resolve_order

# Naming every algorithm of a run (probes included) in `installed` spares the engine
# a scan of all installed distributions at each summary/checkpoint write, which
# costs more than a second per write on this machine.
INSTALLED = discover()
RAW_TRAIN, RAW_EVAL = (torch.cat([x for x, _ in loader]) for loader in tiny_loaders())
CUSTOM = [
    {"name": "RandomCrop", "padding": 2},
    {"name": "RandomHorizontalFlip", "p": 0.5},
    {"name": "ColorJitter", "brightness": 0.2, "contrast": [0.8, 1.2]},
]
PRESETS = [
    {"preset": "light"},
    {"preset": "trivial"},
    {"preset": "randaugment", "randaugment_n": 2},
    {"preset": "custom", "custom": CUSTOM},
]


def train(tmp_path, algos, **kwargs):
    known = {a.name: PluginInfo(a.name, "tests", "0", "helpers", cls=type(a)) for a in algos}
    return _train(tmp_path, algos, installed={**known, **INSTALLED}, **kwargs)


def aug(**options) -> GpuAugmentation:
    return GpuAugmentation(plugin_config(GpuAugmentation, options))


def recorder(**hooks_to_lists):
    """A Probe that keeps a copy of the inputs at each named event."""
    seen = {event: [] for event in hooks_to_lists}
    probe = Probe(
        **{event: (lambda s, e=event: seen[e].append(s.batch[0].clone())) for event in seen}
    )
    return probe, seen


def train_inputs(tmp_path, algos, **kwargs) -> list[torch.Tensor]:
    probe, seen = recorder(before_forward=True)
    train(tmp_path, [*algos, probe], **kwargs)
    return seen["before_forward"]


# -- the pure functions --------------------------------------------------------------


@pytest.mark.parametrize("options", PRESETS, ids=lambda o: o["preset"])
@pytest.mark.parametrize("size", [(16, 16), (24, 20)])
def test_every_preset_changes_the_batch_keeping_shape_dtype_and_range(options, size):
    x = torch.rand(8, 3, *size)
    before = x.clone()
    pipeline = build_augmentation(GpuAugmentationConfig(**options))
    out = augment_batch(x, pipeline, seed=1)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert 0 <= out.min() and out.max() <= 1
    assert not torch.equal(out, x)
    assert torch.equal(x, before), "the input batch must not be modified"
    # Parameters are drawn per sample: images of a batch are not transformed alike.
    same = torch.rand(1, 3, *size).expand(8, -1, -1, -1).contiguous()
    out = augment_batch(same, pipeline, seed=2)
    assert not all(torch.equal(out[0], out[i]) for i in range(1, 8))


def test_same_seed_same_batch_different_seed_different_and_global_rng_untouched():
    x = torch.rand(8, 3, 16, 16)
    pipeline = build_augmentation()
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    a, b, c = (augment_batch(x, pipeline, seed=s) for s in (7, 7, 8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(torch.get_rng_state(), rng)


def test_batch_seed_depends_on_seed_rank_and_batch():
    seeds = {batch_seed(s, r, b) for s in range(3) for r in range(3) for b in range(50)}
    assert len(seeds) == 3 * 3 * 50
    assert batch_seed(0, 0, 5) == batch_seed(0, 0, 5)


def test_a_shape_changing_augmentation_is_refused_at_run_time():
    cfg = GpuAugmentationConfig(preset="custom", custom=[{"name": "RandomCrop", "size": [8, 8]}])
    with pytest.raises(ValueError, match="changed the batch shape"):
        augment_batch(torch.rand(2, 3, 16, 16), build_augmentation(cfg), seed=0)


# -- config validation ---------------------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"preset": "custom", "custom": [{"name": "RandomHorizontalFlp"}]},
            r"custom\[0\]: unknown kornia augmentation 'RandomHorizontalFlp'; "
            r"close matches: RandomHorizontalFlip",
        ),
        (
            {
                "preset": "custom",
                "custom": [
                    {"name": "RandomHorizontalFlip"},
                    {"name": "ColorJitter", "brightnes": 0.2},
                ],
            },
            r"custom\[1\] ColorJitter: unknown argument 'brightnes' \(did you mean 'brightness'",
        ),
        (
            {"preset": "custom", "custom": [{"name": "ColorJitter", "brightness": -1}]},
            r"custom\[0\] ColorJitter: bad arguments .*brightness",
        ),
        (
            {"preset": "custom", "custom": [{"name": "RandomAffine"}]},
            r"custom\[0\] RandomAffine: missing required argument 'degrees'",
        ),
        ({"preset": "custom", "custom": [{"name": "RandomMixUpV2"}]}, r"needs the labels"),
        (
            {"preset": "custom", "custom": [{"name": "Normalize", "mean": 0.5, "std": 0.5}]},
            r"normalises",
        ),
        ({"preset": "custom"}, r"custom is empty"),
        ({"custom": [{"name": "RandomHorizontalFlip"}]}, r"set preset: custom"),
        (
            {"preset": "cutout"},
            r"preset must be one of light, trivial, randaugment, custom, none, got 'cutout'",
        ),
        ({"crop_scale": [0.0, 1.0]}, r"crop_scale must be"),
        ({"flip_p": 2.0}, r"flip_p must be a finite number in \[0, 1\]"),
        ({"cpu_threads": -1}, r"cpu_threads must be a whole number >= 0"),
        ({"preset": "randaugment", "randaugment_m": 30}, r"randaugment_m must be a whole number in \[1, 29\]"),
        (
            {"preset": "randaugment", "randaugment_n": 99},
            r"preset 'randaugment' RandAugment: .*Expect `n`",
        ),
    ],
)
def test_bad_config_is_refused_before_the_run_with_a_clear_message(options, message):
    with pytest.raises(ConfigError, match=message) as info:
        plugin_config(GpuAugmentation, options)
    assert "algorithms.gpu_augmentation" in str(info.value)


def test_ordered_after_the_curriculum_and_before_torch_compile():
    # torch_compile marks the batch's size dynamic at before_forward, where erasing
    # replaces the batch: the mark must land on the tensor the model receives.
    curriculum = type("C", (Algorithm,), {"name": "image_size_curriculum"})()
    compile_ = type("T", (Algorithm,), {"name": "torch_compile"})()
    order = [a.name for a in resolve_order([compile_, GpuAugmentation(), curriculum])]
    assert order == ["image_size_curriculum", "gpu_augmentation", "torch_compile"]


# -- in training -----------------------------------------------------------------------


def test_training_batches_are_augmented_and_off_leaves_them_raw(tmp_path):
    raw = (list(RAW_TRAIN.split(16)) * 2)[:5]  # 4 batches an epoch, unshuffled
    off = train_inputs(tmp_path / "off", [], max_duration="5ba")
    on = train_inputs(tmp_path / "on", [aug()], max_duration="5ba")
    assert all(torch.equal(a, b) for a, b in zip(off, raw, strict=True))
    assert all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(on, raw, strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(on, raw, strict=True))
    assert all(0 <= a.min() and a.max() <= 1 for a in on)
    # A new draw every batch: the same images in epoch 2 are augmented differently.
    assert not torch.equal(on[0], on[4])


def test_eval_batches_are_untouched(tmp_path):
    probe, seen = recorder(eval_batch_start=True, eval_batch_end=True)
    train(tmp_path, [aug(preset="trivial"), probe], max_duration="1ep")
    for event in ("eval_batch_start", "eval_batch_end"):
        assert torch.equal(torch.cat(seen[event]), RAW_EVAL)


def test_same_seed_same_augmented_batches_other_seed_others_global_rng_undisturbed(tmp_path):
    a = train_inputs(tmp_path / "a", [aug()], max_duration="2ba", seed=1)
    b = train_inputs(tmp_path / "b", [aug()], max_duration="2ba", seed=1)
    c = train_inputs(tmp_path / "c", [aug()], max_duration="2ba", seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not any(torch.equal(x, y) for x, y in zip(a, c, strict=True))

    # The global RNG (dropout, samplers) reads the same whether or not batches are augmented.
    states: dict[str, list[torch.Tensor]] = {"off": [], "on": []}
    for name, algos in (("off", []), ("on", [aug()])):
        probe = Probe(before_forward=lambda s, k=name: states[k].append(torch.get_rng_state()))
        train(tmp_path / f"rng-{name}", [*algos, probe], max_duration="2ba")
    assert all(torch.equal(x, y) for x, y in zip(states["off"], states["on"], strict=True))


def test_a_resumed_run_continues_the_same_augmentations(tmp_path):
    whole = train_inputs(tmp_path / "whole", [aug()], max_duration="6ba")
    first = train(tmp_path / "half", [aug()], max_duration="1ep")
    latest = first.run_dir / "checkpoints" / "latest.pt"
    resumed = train_inputs(tmp_path / "half", [aug()], max_duration="6ba", load_path=latest)
    assert len(resumed) == 2
    assert all(torch.equal(x, y) for x, y in zip(whole[4:], resumed, strict=True))


def test_augments_a_cpu_batch_with_cpu_threads_and_restores_the_setting(monkeypatch):
    seen: list[int] = []

    class Recorder(torch.nn.Module):
        def forward(self, x):
            seen.append(torch.get_num_threads())
            return x.flip(-1)

    model = torch.nn.Linear(1, 1)
    state = State(model, torch.optim.SGD(model.parameters()), Duration.parse("1ba"))
    state.batch = (torch.rand(2, 3, 8, 8), torch.zeros(2, dtype=torch.long))
    torch.set_num_threads(2)  # conftest restores the setting after the test
    algo = aug(cpu_threads=1)
    algo.pipeline = Recorder()
    algo.batch_start(state)
    assert seen == [1] and torch.get_num_threads() == 2

    # By default torch's thread count is never changed: switching it and back slows
    # the training step that follows (the card), so not even a same-value call.
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    algo = aug()
    assert algo.config.cpu_threads == 0
    algo.pipeline = Recorder()
    algo.batch_start(state)
    assert seen == [1, 2] and calls == []


class FakeCurriculum(Probe):
    """Stands in for image_size_curriculum: shrinks training batches to 12 px."""

    name = "image_size_curriculum"


def test_augments_the_batch_after_a_resize_to_another_size(tmp_path):
    resized: list[torch.Tensor] = []

    def shrink(state):
        x, y = state.batch
        state.batch = (F.interpolate(x, size=(12, 12), mode="bilinear", antialias=True), y)
        resized.append(state.batch[0].clone())

    # Listed after gpu_augmentation on purpose: the declared order must put it first.
    on = train_inputs(tmp_path, [aug(), FakeCurriculum(batch_start=shrink)], max_duration="3ba")
    assert [tuple(x.shape) for x in on] == [(16, 3, 12, 12)] * 3
    assert not any(torch.equal(a, b) for a, b in zip(on, resized, strict=True))


def test_uint8_batches_are_augmented_as_their_float_twins_and_left_unmodified():
    x = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    kept = x.clone()
    pipeline = place_pipeline(build_augmentation(), x.device)
    from_uint8 = augment_batch(x, pipeline, seed=3)
    from_float = augment_batch(x.float() / 255, pipeline, seed=3)
    assert from_uint8.dtype == torch.float32 and from_uint8.shape == x.shape
    torch.testing.assert_close(from_uint8, from_float)
    assert not torch.equal(from_uint8, x.float() / 255)
    assert torch.equal(x, kept)


class _HostReads(TorchDispatchMode):
    """Counts reads of a tensor's value by the host (``.item()``, ``bool()``,
    ``float()``): on a GPU each one waits for the device."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_a_placed_light_pipeline_reads_no_value_on_the_host():
    # The CPU runs the device's path (ranges held as tensors), so a host read that
    # would synchronise a GPU at every batch shows here. kornia reads the crop's
    # aspect-ratio bounds on the host: held as a tensor, they cost two reads per batch.
    x = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8)
    pipeline = place_pipeline(build_augmentation(), x.device)
    augment_batch(x, pipeline, seed=0)  # builds the crop for this input size
    crop = pipeline[0].by_size["16x16"]._param_generator
    assert isinstance(crop.scale, torch.Tensor) and not isinstance(crop.ratio, torch.Tensor)
    with _HostReads() as counted:
        out = augment_batch(x, pipeline, seed=1)
    assert counted.reads == 0
    assert not torch.equal(out, augment_batch(x, pipeline, seed=2))


def test_tensors_kept_in_a_generators_samplers_move_with_the_pipeline():
    """kornia's uniform generators keep (factor, name, center, bound) entries and put each
    draw on the device of their tensor factors: brightness and contrast in TrivialAugment
    kept theirs on the host, and on a GPU every draw of theirs went there and back. The
    placement moves the tensors it finds in such nested tuples (to ``meta`` here, which
    kornia itself cannot be placed on), and keeps what has nothing to move as it is."""
    factor = torch.tensor([0.5, 1.5])
    samplers = ((factor, "brightness_factor", None, None), ((0.0, 1.0), "thresholds", None, None))
    moved = moved_tensors(samplers, torch.device("meta"))
    assert type(moved) is tuple and moved[0][0].device.type == "meta" and moved[0][1:] == samplers[0][1:]
    assert moved[1] is samplers[1]
    assert moved_tensors(samplers, torch.device("cpu")) is samplers
    assert moved_tensors([factor], torch.device("meta"))[0].device.type == "meta"
    # The trivial preset still trains on the CPU after placement, every draw included.
    x = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8)
    pipeline = place_pipeline(build_augmentation(GpuAugmentationConfig(preset="trivial")), x.device)
    outs = [augment_batch(x, pipeline, seed) for seed in range(30)]
    assert all(o.shape == x.shape and o.dtype == torch.float32 for o in outs)
    assert not torch.equal(outs[0], outs[1])


def test_a_second_random_crop_after_the_loaders_is_warned_about():
    """Issue 41: a photo dataset's loader crops at random by default; the plugin's own
    RandomResizedCrop would crop each image again without a word."""
    import warnings

    from slipstream import State

    plugin = GpuAugmentation()
    state = State.__new__(State)
    state.config = {"data": {"train_crop": "random_resized"}}
    with pytest.warns(UserWarning, match="gpu_augmentation crops batches the loader has already cropped at random"):
        plugin.init(state)
    state.config = {"data": {"train_crop": "center"}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugin.init(state)
