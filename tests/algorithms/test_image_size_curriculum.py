import json
import warnings

import pytest
import timm
import torch
import torch.nn.functional as F
from slipstream_image_size_curriculum import (
    ImageSizeCurriculum,
    ImageSizeCurriculumConfig,
    allow_any_input_size,
    resize_batch,
    size_at,
)

from helpers import Probe, tiny_model, train
from slipstream import ConfigError
from slipstream.plugins.discovery import plugin_config

# tiny_loaders: 64 samples in batches of 16 = 4 batches per epoch.


def curriculum(**options) -> ImageSizeCurriculum:
    return ImageSizeCurriculum(plugin_config(ImageSizeCurriculum, options))


def recording_probe() -> tuple[Probe, list[int], list[int]]:
    """A probe that records the input height seen by the model in training and eval."""
    train_sizes: list[int] = []
    eval_sizes: list[int] = []
    probe = Probe(
        before_forward=lambda s: train_sizes.append(s.batch[0].shape[-1]),
        eval_batch_end=lambda s: eval_sizes.append(s.batch[0].shape[-1]),
    )
    return probe, train_sizes, eval_sizes


def test_sizes_grow_from_initial_to_full_before_the_end(tmp_path):
    probe, sizes, eval_sizes = recording_probe()
    # Evaluated once, at the end.
    trainer = train(tmp_path, [curriculum(), probe], max_duration="10ba", log_interval=1, eval_interval="10ba")
    # Default linear schedule on 16 px data: half size for the first 40% of the run, a
    # ramp, full size for the last 20%.
    assert sizes == [8, 8, 8, 8, 8, 10, 12, 14, 16, 16]
    assert eval_sizes and set(eval_sizes) == {16}  # the final evaluation is never resized
    # The engine logs the size of the batch the model trained on.
    lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    logged = [r["image_size"] for r in map(json.loads, lines) if r["kind"] == "train"]
    assert logged == [[s, s] for s in sizes]


def test_without_the_plugin_sizes_are_constant(tmp_path):
    probe, sizes, _ = recording_probe()
    train(tmp_path, [probe], max_duration="4ba", eval_interval=None)
    assert set(sizes) == {16}


def test_stepped_schedule_in_a_run_with_random_crops(tmp_path):
    probe, sizes, _ = recording_probe()
    algo = curriculum(schedule="stepped", initial_size=4, increment=4, every="2ba", mode="random_crop")
    train(tmp_path, [algo, probe], max_duration="8ba", eval_interval=None)
    assert sizes == [4, 4, 8, 8, 12, 12, 16, 16]


def test_stepped_schedule_matches_borealis_arithmetic():
    # 32 px, +32 px every 5 epochs, up to 224 px.
    cfg = ImageSizeCurriculumConfig(schedule="stepped", initial_size=32, increment=32, every="5ep")
    assert cfg.time_unit == "ep"
    expected = {
        0: 32,
        4.99: 32,
        5: 64,
        9.9: 64,
        10: 96,
        15: 128,
        20: 160,
        25: 192,
        30: 224,
        90: 224,
    }
    assert {t: size_at(cfg, t, 224, 16) for t in expected} == expected


def test_linear_schedule_function():
    cfg = ImageSizeCurriculumConfig()  # 0.5 scale, delay 0.4, finetune 0.2
    assert cfg.time_unit == "dur"
    assert size_at(cfg, 0.0, 224, 16) == 112
    assert size_at(cfg, 0.39, 224, 16) == 112
    assert size_at(cfg, 0.5, 224, 16) == 144  # a quarter up the ramp: 0.625 * 224 = 140
    assert size_at(cfg, 0.8, 224, 16) == 224
    assert size_at(cfg, 1.0, 224, 16) == 224
    sizes = [size_at(cfg, i / 100, 224, 16) for i in range(101)]
    assert sizes == sorted(sizes) and all(s % 16 == 0 for s in sizes)
    # Never below one multiple, never above full size (even when full size is not a multiple).
    tiny = ImageSizeCurriculumConfig(initial_scale=0.01)
    assert size_at(tiny, 0.0, 224, 16) == 16
    assert size_at(ImageSizeCurriculumConfig(initial_scale=0.95), 0.0, 30, 8) == 30
    # delay + finetune = 1: a jump from the initial size to full size.
    jump = ImageSizeCurriculumConfig(delay=0.5, finetune=0.5)
    assert [size_at(jump, t, 64) for t in (0.0, 0.49, 0.5, 1.0)] == [32, 32, 64, 64]


def test_resize_batch_modes():
    x = torch.rand(2, 3, 32, 24)
    assert resize_batch(x, (32, 24)) is x
    out = resize_batch(x, 16)
    expected = F.interpolate(x, size=(16, 16), mode="bilinear", antialias=True, align_corners=False)
    assert torch.equal(out, expected)
    assert resize_batch(x, (16, 12), "nearest").shape == (2, 3, 16, 12)
    crop = resize_batch(x, 8, "random_crop", torch.Generator().manual_seed(3))
    again = resize_batch(x, 8, "random_crop", torch.Generator().manual_seed(3))
    assert crop.shape == (2, 3, 8, 8) and torch.equal(crop, again)
    # A crop is a window of the original pixels.
    windows = x.unfold(2, 8, 1).unfold(3, 8, 1)  # (N, C, 25, 17, 8, 8)
    assert any(torch.equal(windows[:, :, i, j], crop) for i in range(25) for j in range(17))
    with pytest.raises(ValueError, match="mode must be one of"):
        resize_batch(x, 8, "bicubic")


def test_non_dynamic_vit_keeps_its_parameters_and_takes_any_size(tmp_path):
    torch.manual_seed(0)
    model = timm.create_model("test_vit", num_classes=4, img_size=32, patch_size=8, dynamic_img_size=False)
    before = {name: (p.shape, id(p)) for name, p in model.named_parameters()}
    model.eval()
    x = torch.rand(2, 3, 32, 32)
    reference = model(x)
    with pytest.raises(AssertionError):
        model(torch.rand(2, 3, 16, 16))  # timm refuses other sizes before the switch

    assert allow_any_input_size(model) == (8, 8)
    assert torch.equal(model(x), reference)  # unchanged at its own size
    assert model(torch.rand(2, 3, 16, 16)).shape == (2, 4)
    assert model(torch.rand(2, 3, 16, 24)).shape == (2, 4)
    assert {name: (p.shape, id(p)) for name, p in model.named_parameters()} == before
    assert allow_any_input_size(tiny_model("resnet")) is None

    # Through the plugin: sizes are multiples of the patch (8), the parameters untouched.
    fresh = timm.create_model("test_vit", num_classes=4, img_size=32, patch_size=8, dynamic_img_size=False)
    before = {name: (p.shape, id(p)) for name, p in fresh.named_parameters()}
    probe, sizes, _ = recording_probe()
    algo = curriculum(initial_scale=0.3)  # 0.3 * 32 = 9.6 -> 8
    trainer = train(tmp_path, [algo, probe], model=fresh, image_size=32, max_duration="3ep", eval_interval=None)
    assert sizes[0] == 8 and sizes[-1] == 32
    assert set(sizes) <= {8, 16, 24, 32} and len(set(sizes)) > 2
    after = trainer.state.unwrapped_model.named_parameters()
    assert {name: (p.shape, id(p)) for name, p in after} == before


def test_fixed_size_model_is_refused():
    class FixedEmbed(torch.nn.Module):
        patch_size = (4, 4)
        strict_img_size = True

    model = torch.nn.Module()
    model.patch_embed = FixedEmbed()
    with pytest.raises(ConfigError, match="only takes its own input size"):
        allow_any_input_size(model)


def test_size_multiple_must_fit_the_patch(tmp_path):
    with pytest.raises(ConfigError, match="size_multiple=12 is not a multiple of the model's patch size 8"):
        train(
            tmp_path,
            [curriculum(size_multiple=12)],
            model=tiny_model("vit", image_size=32),
            image_size=32,
        )


def test_stepped_schedule_that_ends_early_warns(tmp_path):
    # 4 -> 16 px in steps of 3 takes 4 x 0.25dur: full size only when the run is over.
    algo = curriculum(schedule="stepped", initial_size=4, increment=3, every="0.25dur")
    with pytest.warns(UserWarning, match="after 4 x 0.25dur, at or past the end of this 1ba run"):
        train(tmp_path, [algo], max_duration="1ba", eval_interval=None)
    # In steps of 4 it takes 3 x 0.25dur: the last quarter is at full size, no warning.
    algo = curriculum(schedule="stepped", initial_size=4, increment=4, every="0.25dur")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        train(tmp_path / "quiet", [algo], max_duration="1ba", eval_interval=None)


def test_state_is_saved_and_restored(tmp_path):
    # A ramp over the whole run, so the last batch (7 of 8) is still below full size.
    probe, sizes, _ = recording_probe()
    algo = curriculum(delay=0, finetune=0)
    trainer = train(tmp_path, [algo, probe], max_duration="2ep", eval_interval=None)
    checkpoint = trainer.run_dir / "checkpoints" / "latest.pt"
    saved = torch.load(checkpoint, weights_only=True)["plugins"]["image_size_curriculum"]
    assert sizes[-1] == 15  # 16 * (0.5 + 0.5 * 7/8)
    assert saved["state"] == {"size": [15, 15]}
    assert saved["config"]["delay"] == 0

    restored = curriculum(delay=0, finetune=0)
    seen = {}
    probe = Probe(fit_start=lambda s: seen.setdefault("size", restored.size))
    resumed = train(tmp_path, [restored, probe], max_duration="3ep", load_path=checkpoint, eval_interval=None)
    assert seen["size"] == (15, 15)
    assert resumed.state.timestamp.batch == 12 and restored.size == (15, 15)


def _inputs_probe(stop_at: int | None = None) -> tuple[Probe, dict[int, torch.Tensor]]:
    """Records the model's training inputs by step; stops the run after ``stop_at``."""
    inputs: dict[int, torch.Tensor] = {}

    def batch_end(state):
        if state.timestamp.batch == stop_at:
            state.stop_requested = True

    probe = Probe(
        before_forward=lambda s: inputs.__setitem__(s.timestamp.batch + 1, s.batch[0].clone()),
        batch_end=batch_end,
    )
    return probe, inputs


def test_a_run_resumed_mid_schedule_trains_on_the_same_sizes_and_crops(tmp_path):
    # What a resume must restore is the schedule's position and the random crops:
    # the batches after the resume equal those of the run that was never stopped.
    options = {"delay": 0, "finetune": 0, "initial_scale": 0.25, "mode": "random_crop"}
    whole_probe, whole = _inputs_probe()
    train(tmp_path / "whole", [curriculum(**options), whole_probe], max_duration="2ep", eval_interval=None)
    first_probe, _ = _inputs_probe(stop_at=5)  # mid-epoch, mid-ramp
    first = train(tmp_path / "split", [curriculum(**options), first_probe], max_duration="2ep", eval_interval=None)
    assert first.state.timestamp.batch == 5
    probe, after = _inputs_probe()
    train(
        tmp_path / "split",
        [curriculum(**options), probe],
        max_duration="2ep",
        eval_interval=None,
        load_path=first.run_dir / "checkpoints" / "latest.pt",
    )
    assert sorted(after) == [6, 7, 8]
    assert [whole[step].shape[-1] for step in after] == [12, 13, 15]  # still growing
    for step, batch in after.items():
        assert torch.equal(batch, whole[step]), f"step {step} differs after the resume"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"schedule": "cosine"}, "schedule must be one of linear, stepped, got 'cosine'"),
        ({"mode": "bicubic"}, "mode must be one of bilinear, nearest, random_crop"),
        ({"initial_scale": 0.0}, "initial_scale must be a finite number in (0, 1]"),
        ({"delay": 1.5}, "delay must be a finite number in [0, 1] (a fraction of the run)"),
        ({"delay": 0.7, "finetune": 0.5}, "delay + finetune must be at most 1"),
        ({"increment": 0}, "increment must be a whole number >= 1 (pixels)"),
        ({"every": "5 epochs"}, "every: '5 epochs' is not a duration"),
        ({"every": "0ep"}, "every must be a positive duration"),
        ({"size_multiple": -1}, "size_multiple must be a whole number >= 0"),
        ({"sizes": 3}, "unknown key 'sizes'"),
    ],
)
def test_config_errors(options, message):
    with pytest.raises(ConfigError) as info:
        plugin_config(ImageSizeCurriculum, options)
    assert "image_size_curriculum" in str(info.value)
    assert message in str(info.value)


# -- in_loader: the loader cuts each epoch's images at the curriculum's size ----------------

# 24 px data, 2 epochs of 2 batches: 12, 15 -> 18, 18, 21 -> 24 px (multiples of 6: fewer sizes, fewer FLOP counts)
RAMP = {"delay": 0, "finetune": 0, "initial_scale": 0.5, "size_multiple": 6}


@pytest.fixture(scope="module")
def photo_tree(tmp_path_factory):
    from test_geometry import photo

    root = tmp_path_factory.mktemp("curriculum_photos")
    for split in ("train", "val"):
        for i in range(8):
            folder = root / split / f"c{i % 4}"
            folder.mkdir(parents=True, exist_ok=True)
            photo(i).save(folder / f"{i}.jpg", quality=92)
    return root


def photo_loaders(root, size: int = 24):
    from slipstream.config.schema import build_config
    from slipstream.data import DataRequest, build_dataset_plugin
    from slipstream.data.geometry import geometries

    cfg = build_config(None, None, ["data.name=imagefolder", f"data.root={root}", f"data.image_size={size}"])
    train_g, eval_g = geometries(cfg.data, True, seed=3)
    request = DataRequest(image_size=size, batch_size=4, eval_batch_size=4, seed=3,
                          train_geometry=train_g, eval_geometry=eval_g)  # fmt: skip
    built = build_dataset_plugin(dict(cfg.data)).build(request)
    return built.train, built.eval


def _photo_run(path, root, options, **kwargs):
    probe, inputs = _inputs_probe(kwargs.pop("stop_at", None))
    train_data, _ = photo_loaders(root)
    # Not normalised: the inputs are the loader's pixels / 255.
    kwargs.setdefault("checkpoint_interval", None)  # only the run that is resumed writes one
    trainer = train(path, [curriculum(**options), probe], train_data=train_data, max_duration="2ep",
                    eval_interval=None, image_size=24, normalize=None, **kwargs)  # fmt: skip
    return trainer, inputs


def test_in_loader_the_workers_cut_each_batch_at_its_size_and_resume_exactly(photo_tree, tmp_path):
    from slipstream import to_unit_float

    _, told = _photo_run(tmp_path / "told", photo_tree, RAMP)  # in_loader is on by default
    assert [told[step].shape[-1] for step in sorted(told)] == [12, 18, 18, 24]  # batch by batch
    # The same crops as a loader made at 12 px: the box is drawn on the whole picture,
    # whatever the output size, and cut straight to it. (allclose: the engine's division
    # may round the last bit otherwise than to_unit_float's.)
    small, _ = photo_loaders(photo_tree, 12)
    small.sampler.set_epoch(0)
    assert torch.allclose(to_unit_float(next(iter(small))[0]), told[1], atol=1e-6)
    # Off: full-size crops shrunk on the device (other pixels, the same sizes).
    _, resized = _photo_run(tmp_path / "resized", photo_tree, {**RAMP, "in_loader": False})
    assert [resized[step].shape[-1] for step in sorted(resized)] == [12, 18, 18, 24]
    assert (resized[1] - told[1]).abs().mean() > 1e-3
    # Stopped mid-epoch 0 and resumed: the epoch's sizes are told again, the same crops follow.
    first, _ = _photo_run(tmp_path / "split", photo_tree, RAMP, stop_at=1, checkpoint_interval="1ba")
    checkpoint = first.run_dir / "checkpoints" / "latest.pt"
    _, after = _photo_run(tmp_path / "split", photo_tree, RAMP, load_path=checkpoint)
    assert sorted(after) == [2, 3, 4]
    for step, batch in after.items():
        assert torch.equal(batch, told[step]), f"step {step} differs after the resume"


def test_in_loader_on_data_that_cannot_or_another_mode_resizes_on_the_device(photo_tree):
    from helpers import tiny_loaders

    algo = curriculum()
    assert algo.loader_cuts(photo_loaders(photo_tree)[0])
    assert not algo.loader_cuts(tiny_loaders()[0])  # tensors in memory: nothing cuts them
    assert not curriculum(mode="random_crop").loader_cuts(photo_loaders(photo_tree)[0])
