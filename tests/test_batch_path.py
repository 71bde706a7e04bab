"""The lean batch path: uint8 from the dataset to batch_start, one conversion to float
(normalised, in the model's memory format) on the device after every batch transform."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from slipstream_channels_last import ChannelsLast, ChannelsLastConfig
from slipstream_gpu_augmentation import GpuAugmentation
from torch.utils.data import DataLoader, TensorDataset

from helpers import Probe, tiny_model
from slipstream import Trainer, to_unit_float
from slipstream.data import DATASET_STATS, SyntheticShapes, build_datasets, build_loader
from slipstream.services import Normalize
from test_data import _fake_cifar10, _image_tree

CL = torch.channels_last


def fit(
    tmp_path: Path, train_data, algorithms=(), eval_data=None, num_classes=4, **kwargs
) -> Trainer:
    model = tiny_model(num_classes=num_classes)
    trainer = Trainer(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        train_data=train_data,
        eval_data=eval_data,
        algorithms=list(algorithms),
        run_dir=tmp_path / "run",
        device="cpu",
        progress_bar=False,
        verbose=False,
        **{"max_duration": "2ba", "eval_interval": None, **kwargs},
    )
    trainer.fit()
    return trainer


def synthetic_loaders(batch_size: int = 16):
    train, val, _ = build_datasets(
        "synthetic", image_size=16, train_size=64, val_size=16, num_classes=4
    )
    return (
        build_loader(train, batch_size=batch_size, seed=0),
        build_loader(val, batch_size=batch_size, shuffle=False, drop_last=False),
    )


def recorder():
    seen: dict[str, list[torch.Tensor]] = {"raw": [], "model": [], "eval_raw": [], "eval_model": []}

    def keep(key):
        return lambda s: seen[key].append(s.batch[0].clone(memory_format=torch.preserve_format))

    probe = Probe(
        batch_start=keep("raw"),
        before_forward=keep("model"),
        eval_batch_start=keep("eval_raw"),
        eval_batch_end=keep("eval_model"),
    )
    return probe, seen


# -- uint8 up to batch_start --------------------------------------------------------------


@pytest.mark.parametrize("name", ["synthetic", "cifar10", "imagefolder"])
def test_uint8_reaches_batch_start_from_every_built_in_dataset(tmp_path, monkeypatch, name):
    if name == "cifar10":
        _fake_cifar10(tmp_path, monkeypatch)
    if name == "imagefolder":
        _image_tree(tmp_path, {"a": 4, "b": 4})
    train, val, num_classes = build_datasets(
        name, root=tmp_path, image_size=16, train_size=32, val_size=8, num_classes=4
    )
    probe, seen = recorder()
    fit(
        tmp_path,
        build_loader(train, batch_size=4),
        [probe],
        eval_data=build_loader(val, batch_size=4, shuffle=False, drop_last=False),
        normalize=DATASET_STATS[name],
        max_duration="1ba",
        eval_interval="1ba",
        num_classes=num_classes,
    )
    assert {x.dtype for x in seen["raw"] + seen["eval_raw"]} == {torch.uint8}
    assert {x.dtype for x in seen["model"] + seen["eval_model"]} == {torch.float32}


# -- what the model receives --------------------------------------------------------------


@pytest.mark.parametrize("channels_last", [True, False], ids=["channels_last", "nchw"])
def test_the_model_receives_normalised_float_in_the_format_it_wants(tmp_path, channels_last):
    probe, seen = recorder()
    algorithms = [ChannelsLast(ChannelsLastConfig(mode="always")), probe] if channels_last else [probe]
    train_loader, eval_loader = synthetic_loaders()
    mean, std = DATASET_STATS["synthetic"]
    fit(tmp_path, train_loader, algorithms, eval_data=eval_loader, normalize=(mean, std),
        eval_interval="2ba")  # fmt: skip
    m, s = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    for raw_key, model_key in (("raw", "model"), ("eval_raw", "eval_model")):
        for raw, fed in zip(seen[raw_key], seen[model_key], strict=True):
            assert fed.dtype == torch.float32
            torch.testing.assert_close(fed, (raw.float() / 255 - m) / s)
            if channels_last:
                assert fed.is_contiguous(memory_format=CL) and not fed.is_contiguous()
            else:
                assert fed.is_contiguous()


def test_without_normalisation_uint8_still_reaches_the_model_as_float_in_0_1(tmp_path):
    probe, seen = recorder()
    fit(tmp_path, synthetic_loaders()[0], [probe], normalize=None)
    for raw, fed in zip(seen["raw"], seen["model"], strict=True):
        assert raw.dtype == torch.uint8 and fed.dtype == torch.float32
        torch.testing.assert_close(fed, raw.float() / 255)
        assert fed.min() >= 0 and fed.max() <= 1


@pytest.mark.parametrize("v2", [False, True])
def test_auto_leaves_inputs_a_torchvision_transform_already_normalised(tmp_path, v2):
    from torchvision import datasets, transforms
    from torchvision.transforms import v2 as transforms_v2

    _image_tree(tmp_path / "images", {"cat": 2, "dog": 2})
    mean, std = DATASET_STATS["imagefolder"]
    if v2:
        to_tensor = [transforms_v2.ToImage(), transforms_v2.ToDtype(torch.float32, scale=True)]
        resize, norm = transforms_v2.Resize((16, 16)), transforms_v2.Normalize(mean, std)
        compose = transforms_v2.Compose
    else:
        to_tensor = [transforms.ToTensor()]
        resize, norm = transforms.Resize((16, 16)), transforms.Normalize(mean, std)
        compose = transforms.Compose
    for normalised_by_the_data in (True, False):
        steps = [resize, *to_tensor, *([transforms.RandomApply([norm], p=1.0)] if normalised_by_the_data else [])]
        folder = datasets.ImageFolder(tmp_path / "images" / "train", transform=compose(steps))
        probe, seen = recorder()
        fit(tmp_path / str(normalised_by_the_data), DataLoader(folder, batch_size=4), [probe], num_classes=2)
        m, s = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
        for raw, fed in zip(seen["raw"], seen["model"], strict=True):
            # Normalised once: by the dataset's own transform, else by the engine (auto).
            expected = raw if normalised_by_the_data else (raw - m) / s
            torch.testing.assert_close(fed, expected)


def test_a_float_loader_trains_unchanged_and_matches_its_uint8_twin(tmp_path):
    # The same pictures as float [0, 1] and as uint8: the model gets the same inputs
    # (to float rounding), and the float loader's tensors are never written into.
    x = torch.randint(0, 256, (32, 3, 16, 16), dtype=torch.uint8)
    y = torch.arange(32) % 4
    as_float = x.float() / 255
    kept = as_float.clone()
    fed = {}
    for kind, images in (("uint8", x), ("float", as_float)):
        probe, seen = recorder()
        loader = DataLoader(TensorDataset(images, y), batch_size=8)
        fit(tmp_path / kind, loader, [probe], normalize=((0.5,) * 3, (0.25,) * 3),
            max_duration="1ep")  # fmt: skip
        fed[kind] = torch.cat(seen["model"])
    torch.testing.assert_close(fed["uint8"], fed["float"])
    assert torch.equal(as_float, kept)


def test_a_float_batch_that_needs_no_copy_is_not_modified_in_place():
    norm = Normalize((0.5,) * 3, (0.25,) * 3)
    x = torch.rand(2, 3, 4, 4)
    before = x.clone()
    out = norm((x, None), torch.contiguous_format)[0]
    assert torch.equal(x, before)
    torch.testing.assert_close(out, (x - 0.5) / 0.25)


def test_to_unit_float():
    x = torch.tensor([[0, 51, 255]], dtype=torch.uint8)
    assert torch.equal(to_unit_float(x), torch.tensor([[0.0, 0.2, 1.0]]))
    f = torch.rand(3)
    assert to_unit_float(f) is f  # float is already in [0, 1]: no copy
    cl = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8).contiguous(memory_format=CL)
    assert to_unit_float(cl).is_contiguous(memory_format=CL)
    with pytest.raises(TypeError, match="uint8.*floating point.*int64"):
        to_unit_float(torch.zeros(2, dtype=torch.int64))


# -- augmentation and resume on the uint8 path --------------------------------------------


def test_augmentation_of_uint8_batches_differs_per_batch_and_is_reproducible(tmp_path):
    runs = []
    for name in ("a", "b"):
        probe, seen = recorder()
        fit(tmp_path / name, synthetic_loaders()[0], [GpuAugmentation(), probe],
            normalize=None, max_duration="3ba")  # fmt: skip
        runs.append(seen)
    a, b = runs
    for raw, fed in zip(a["raw"], a["model"], strict=True):
        assert not torch.equal(fed, raw.float() / 255)  # augmented
        assert 0.0 <= fed.min() and fed.max() <= 1.0
    assert all(torch.equal(x, y) for x, y in zip(a["model"], b["model"], strict=True))


def test_mid_epoch_resume_is_bit_exact_on_the_uint8_path(tmp_path):
    def run(where, duration, **kwargs):
        algorithms = [ChannelsLast(), GpuAugmentation()]
        return fit(tmp_path / where, synthetic_loaders()[0], algorithms,
                   normalize=DATASET_STATS["synthetic"], max_duration=duration, **kwargs)  # fmt: skip

    straight = run("straight", "6ba", checkpoint_interval=None)
    first = run("split", "3ba", checkpoint_interval="3ba")  # None writes none
    resumed = run("split", "6ba", load_path=first.run_dir / "checkpoints" / "latest.pt")
    for a, b in zip(straight.state.model.parameters(), resumed.state.model.parameters(),
                    strict=True):  # fmt: skip
        assert torch.equal(a, b)


def test_synthetic_items_are_views_not_copies():
    ds = SyntheticShapes(4, image_size=16)
    image, _ = ds[1]
    assert image.dtype == torch.uint8 and image.data_ptr() == ds.images[1].data_ptr()
