"""colout: training batches lose random rows and columns on the device, seeded per batch
(same seed, same batches; exact resume; global RNG untouched); evaluation untouched;
bad options one line; a ViT that takes one size only refused by name."""

from __future__ import annotations

import pytest
import torch
from slipstream_colout import ColOut, colout_batch, kept_size

from helpers import Probe, error_lines, tiny_loaders, tiny_model
from helpers import train as _train
from slipstream import Algorithm, ConfigError
from slipstream.plugins.discovery import PluginInfo, discover, plugin_config, resolve_order

INSTALLED = discover()  # named in each run: spares a scan of the installed plugins per write
RAW_TRAIN = torch.cat([x for x, _ in tiny_loaders()[0]])
QUICK = {"eval_interval": None, "checkpoint_interval": None}


def train(tmp_path, algos, **kwargs):
    known = {a.name: PluginInfo(a.name, "tests", "0", "helpers", cls=type(a)) for a in algos}
    return _train(tmp_path, algos, installed={**known, **INSTALLED}, **kwargs)


def colout(**options) -> ColOut:
    return ColOut(plugin_config(ColOut, options))


def recorded(tmp_path, algos, event="before_forward", **kwargs) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    train(tmp_path, [*algos, Probe(**{event: lambda s: seen.append(s.batch[0].clone())})], **kwargs)
    return seen


# -- the functional API -----------------------------------------------------------------


@pytest.mark.parametrize("batch", [True, False])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_rows_and_columns_are_dropped_in_order_batch_or_per_image(batch, dtype):
    images = (torch.rand(4, 3, 20, 16) * 255).to(dtype)
    out = colout_batch(images, 0.15, 0.25, torch.Generator().manual_seed(0), batch=batch)
    assert out.shape == (4, 3, 17, 12) and out.dtype == dtype
    # The same draw on an image of pixel indices says which rows and columns were kept.
    index = torch.arange(20 * 16, dtype=torch.float32).reshape(1, 1, 20, 16).expand(4, 3, 20, 16)
    kept = colout_batch(index, 0.15, 0.25, torch.Generator().manual_seed(0), batch=batch).long()
    rows, cols = kept // 16, kept % 16
    assert (rows.diff(dim=2) > 0).all() and (rows.diff(dim=3) == 0).all()  # whole rows, in order
    assert (cols.diff(dim=3) > 0).all() and (cols.diff(dim=2) == 0).all()  # whole columns, in order
    assert torch.equal(out, images.flatten(2).gather(2, kept.flatten(2)).view_as(out))
    # Batch mode: the same rows and columns for every image; per image: not.
    assert all(torch.equal(kept[0], k) for k in kept) is batch
    # Same generator seed, same result; another seed, another.
    again = colout_batch(images, 0.15, 0.25, torch.Generator().manual_seed(0), batch=batch)
    other = colout_batch(images, 0.15, 0.25, torch.Generator().manual_seed(1), batch=batch)
    assert torch.equal(out, again) and not torch.equal(out, other)


def test_sizes_as_composer_keeps_them_and_zero_drops_nothing():
    assert [kept_size(s, 0.15) for s in (16, 32, 64, 224)] == [13, 27, 54, 190]
    assert kept_size(224, 0.15, multiple=16) == 192 and kept_size(16, 0.5, multiple=8) == 8
    assert kept_size(2, 0.9) == 1
    images = torch.rand(2, 3, 8, 8)
    assert colout_batch(images, 0.0, 0.0) is images
    with pytest.raises(ValueError, match=r"p_row must be a finite number in \[0, 1\)"):
        colout_batch(images, 1.0, 0.1)
    with pytest.raises(TypeError, match=r"colout: needs a batch of images \(N, C, H, W\), got a 3-D tensor"):
        colout_batch(images[0], 0.1, 0.1)


# -- in training ------------------------------------------------------------------------


def test_training_batches_shrink_differ_by_batch_and_off_leaves_them_raw(tmp_path):
    on = recorded(tmp_path / "on", [colout()], max_duration="5ba", **QUICK)
    off = recorded(tmp_path / "off", [], max_duration="1ba", **QUICK)
    assert {tuple(x.shape) for x in on} == {(16, 3, 13, 13)}
    assert off[0].shape == (16, 3, 16, 16)
    # The same images in epoch 2 (4 batches an epoch, unshuffled) lose other rows and columns.
    assert not torch.equal(on[0], on[4])


def test_evaluation_is_untouched_and_the_metrics_log_the_smaller_size(tmp_path):
    seen: list[tuple] = []
    probe = Probe(eval_batch_end=lambda s: seen.append(tuple(s.batch[0].shape)))
    trainer = train(tmp_path, [colout(p_row=0.5, p_col=0.25), probe], max_duration="1ep", checkpoint_interval=None)
    assert set(seen) == {(16, 3, 16, 16)}
    assert trainer.state.algorithms[0].size == (8, 12)


def test_same_seed_same_batches_other_seed_others_global_rng_untouched(tmp_path):
    rng: dict[str, list[torch.Tensor]] = {"off": [], "on": []}
    seen: dict[str, list[torch.Tensor]] = {"a": [], "b": [], "c": [], "off": []}

    def probe(name, rng_key=None):
        def record(state):
            seen[name].append(state.batch[0].clone())
            if rng_key:
                rng[rng_key].append(torch.get_rng_state())
        return Probe(before_forward=record)

    for name, seed, algos, key in (("a", 1, [colout()], "on"), ("b", 1, [colout()], None),
                                   ("c", 2, [colout()], None), ("off", 1, [], "off")):
        train(tmp_path / name, [*algos, probe(name, key)], max_duration="2ba", seed=seed, **QUICK)
    assert all(torch.equal(x, y) for x, y in zip(seen["a"], seen["b"], strict=True))
    assert not any(torch.equal(x, y) for x, y in zip(seen["a"], seen["c"], strict=True))
    # The global RNG (dropout, samplers) reads the same whether or not ColOut runs.
    assert all(torch.equal(x, y) for x, y in zip(rng["off"], rng["on"], strict=True))


def test_a_resumed_run_continues_the_same_batches_and_weights(tmp_path):
    whole_inputs: list[torch.Tensor] = []
    probe = Probe(before_forward=lambda s: whole_inputs.append(s.batch[0].clone()))
    whole = train(tmp_path / "whole", [colout(batch=False), probe], max_duration="6ba", eval_interval=None)
    first = train(tmp_path / "half", [colout(batch=False), Probe()], max_duration="1ep", eval_interval=None)
    latest = first.run_dir / "checkpoints" / "latest.pt"
    resumed_inputs: list[torch.Tensor] = []
    probe = Probe(before_forward=lambda s: resumed_inputs.append(s.batch[0].clone()))
    resumed = train(tmp_path / "half", [colout(batch=False), probe], max_duration="6ba", load_path=latest,
                    eval_interval=None)
    assert len(resumed_inputs) == 2
    assert all(torch.equal(x, y) for x, y in zip(whole_inputs[4:], resumed_inputs, strict=True))
    a, b = whole.state.unwrapped_model.state_dict(), resumed.state.unwrapped_model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_vit_of_one_size_is_refused_by_name_and_a_dynamic_one_keeps_whole_patches(tmp_path):
    import timm

    fixed = timm.create_model("test_vit", num_classes=4, img_size=16, patch_size=8, dynamic_img_size=False)
    with pytest.raises(ConfigError) as info:
        train(tmp_path / "fixed", [colout()], model=fixed, max_duration="1ba", **QUICK)
    assert len(error_lines(str(info.value))) == 1
    assert str(info.value).startswith("colout cannot change VisionTransformer: it only takes its own input size")
    sizes = recorded(tmp_path / "dyn", [colout(p_row=0.4, p_col=0.4)], model=tiny_model("vit"),
                     max_duration="1ba", **QUICK)
    assert sizes[0].shape[-2:] == (8, 8)  # 16 * 0.6 = 9.6 -> 9 -> the nearest multiple of 8


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"p_row": 1.0}, r"p_row must be a finite number in \[0, 1\)"),
        ({"p_col": -0.1}, r"p_col must be a finite number in \[0, 1\)"),
        ({"batch": "maybe"}, r"batch"),
        ({"p": 0.2}, r"allowed keys: p_row, p_col, batch"),
    ],
)
def test_bad_options_are_one_line_naming_the_key(options, message):
    with pytest.raises(ConfigError, match=message) as info:
        plugin_config(ColOut, options)
    assert "algorithms.colout" in str(info.value) and len(error_lines(str(info.value))) == 1


def test_ordered_after_a_resize_and_before_augmentation_and_mixing():
    names = ["gpu_augmentation", "mixup", "image_size_curriculum"]
    stand_ins = [type(n, (Algorithm,), {"name": n})() for n in names]
    order = [a.name for a in resolve_order([*stand_ins, ColOut()])]
    assert order.index("image_size_curriculum") < order.index("colout") < order.index("gpu_augmentation")
    assert order.index("colout") < order.index("mixup")
