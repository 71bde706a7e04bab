"""Repeated augmentation (``data.repeats``): DeiT's RASampler / timm's RepeatAugSampler
semantics in the engine's EpochSampler, each copy cropped differently, exact resume."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import Dataset

from helpers import Probe, error_lines, tiny_model
from slipstream import ConfigError, Trainer
from slipstream.config.schema import build_config
from slipstream.data import EpochSampler, Geometry, build_loader
from slipstream.data.datasets import Geometric
from slipstream.data.sampler import epoch_seed
from slipstream.plugins.discovery import PluginInfo, discover
from slipstream.run.build import build_trainer

INSTALLED = discover()


def keys(world_size: int, repeats: int, n: int = 24, batch_size: int = 2, **kwargs) -> list[list]:
    """Each rank's keys of epoch 1, as (index, repeat) pairs."""
    out = []
    for rank in range(world_size):
        sampler = EpochSampler(
            n, batch_size=batch_size, seed=3, rank=rank, world_size=world_size, keyed=True, repeats=repeats, **kwargs
        )
        sampler.set_epoch(1)
        got = [(int(k), k.repeat) for k in sampler]
        assert len(got) == len(sampler)
        out.append(got)
    return out


def test_repeats_1_is_the_order_without_repeats() -> None:
    # The order as it was defined before repeats: one permutation of (seed, epoch), rank r
    # taking the r-th contiguous slice of each global batch, every key's repeat 0.
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(epoch_seed(3, 1))).tolist()
    for world_size in (1, 2, 3):
        for rank, got in enumerate(keys(world_size, 1, batch_size=4)):
            want = [perm[b * 4 * world_size + rank * 4 + i] for b in range(24 // (4 * world_size)) for i in range(4)]
            assert got == [(i, 0) for i in want]


def test_each_sample_thrice_on_different_ranks_with_equal_batches() -> None:
    for world_size in (1, 3, 4):
        ranks = keys(world_size, 3, n=48, batch_size=4)
        assert len({len(r) for r in ranks}) == 1  # every rank the same number of batches
        everything = [k for r in ranks for k in r]
        assert len(everything) == 48  # an epoch keeps the dataset's length ...
        counts = Counter(i for i, _ in everything)
        assert set(counts.values()) == {3} and len(counts) == 16  # ... of a third of it, thrice each
        assert len(set(everything)) == 48  # repeats 0, 1, 2 of each sample
        if world_size >= 3:  # DeiT: a sample's copies go to different ranks
            for i in counts:
                assert len({r for r, got in enumerate(ranks) for j, _ in got if j == i}) == 3
    # The samples of a global batch do not depend on the world size (same global batch).
    one, four = keys(1, 3, n=48, batch_size=8), keys(4, 3, n=48, batch_size=2)
    for b in range(6):
        assert sorted(one[0][8 * b : 8 * b + 8]) == sorted(k for r in four for k in r[2 * b : 2 * b + 2])
    # A partial last global batch kept (drop_last=False) still splits evenly.
    assert [len(r) for r in keys(2, 3, n=13, batch_size=3, drop_last=False)] == [7, 6]


def test_resume_in_the_middle_of_an_epoch_continues_the_order() -> None:
    whole = EpochSampler(30, batch_size=2, seed=5, rank=1, world_size=3, keyed=True, repeats=3)
    whole.set_epoch(2)
    tail = EpochSampler(30, batch_size=2, seed=5, rank=1, world_size=3, keyed=True, repeats=3)
    tail.load_state_dict({"epoch": 2, "start_batch": 2})
    assert [(int(k), k.repeat) for k in tail] == [(int(k), k.repeat) for k in list(whole)[4:]]
    with pytest.raises(ValueError, match="repeats must be a whole number >= 1"):
        EpochSampler(30, batch_size=2, repeats=0)


class Images(Dataset):
    """uint8 images whose pixels say where a crop came from (a gradient per sample)."""

    def __init__(self, n: int = 24, size: int = 24) -> None:
        ramp = torch.arange(size * size, dtype=torch.float32).reshape(1, size, size) * 255 / (size * size)
        self.images = [((ramp + 7 * i) % 256).to(torch.uint8).expand(3, -1, -1).clone() for i in range(n)]

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i], i % 4


def test_each_repeat_is_cropped_differently_and_the_first_as_without_repeats() -> None:
    data = Geometric(Images(), Geometry(16, crop="random_resized", hflip=0.5, seed=1))
    plain = next(iter(build_loader(data, batch_size=6, seed=2)))
    repeated = next(iter(build_loader(data, batch_size=6, seed=2, repeats=3)))
    # Positions 0-2 are one sample's repeats 0, 1, 2; 3-5 the next sample's.
    assert repeated[1].tolist() == [plain[1][0]] * 3 + [plain[1][1]] * 3
    assert not torch.equal(repeated[0][0], repeated[0][1]) and not torch.equal(repeated[0][1], repeated[0][2])
    # Repeat 0 is the crop a run without repeats gives that sample in that epoch.
    assert torch.equal(repeated[0][0], plain[0][0]) and torch.equal(repeated[0][3], plain[0][1])


def test_trainer_resume_mid_epoch_is_exact(tmp_path) -> None:
    def run(name: str, duration: str, **kwargs) -> tuple[Trainer, list[torch.Tensor]]:
        seen: list[torch.Tensor] = []
        data = Geometric(Images(), Geometry(16, crop="random_resized", hflip=0.5, seed=1))
        model = tiny_model()
        trainer = Trainer(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            train_data=build_loader(data, batch_size=8, seed=0, repeats=3),
            max_duration=duration,
            algorithms=[Probe(before_forward=lambda s: seen.append(s.batch[0].clone()))],
            run_dir=tmp_path / name,
            device="cpu",
            progress_bar=False,
            verbose=False,
            eval_interval=None,
            # Named, so that writing the summary does not scan every installed distribution.
            installed={**INSTALLED, "probe": PluginInfo("probe", "tests", "0", "helpers", cls=Probe)},
            **kwargs,
        )
        trainer.fit()
        return trainer, seen

    # 3 batches an epoch: the checkpoint after batch 2 is inside epoch 0.
    straight, all_batches = run("straight", "4ba", checkpoint_interval="2ba", checkpoint_keep=-1)
    resumed, rest = run("resumed", "4ba", checkpoint_interval=None,
                        load_path=tmp_path / "straight" / "checkpoints" / "ep0-ba2.pt")
    assert len(rest) == 2 and all(torch.equal(a, b) for a, b in zip(all_batches[2:], rest, strict=True))
    for a, b in zip(straight.state.model.parameters(), resumed.state.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_config_key_reaches_the_loader_and_bad_values_are_one_line(capsys) -> None:
    tiny = ["model.name=test_resnet", "data.train_size=24", "data.val_size=8", "data.image_size=16",
            "data.batch_size=4", "trainer.threads=1"]
    assert build_config(overrides=tiny).data.repeats == 1
    trainer = build_trainer(build_config(overrides=[*tiny, "data.repeats=3"]), verbose=False)
    assert trainer.state.train_loader.sampler.repeats == 3
    for value in ("0", "-2"):
        with pytest.raises(ConfigError) as error:
            build_config(overrides=[f"data.repeats={value}"])
        assert "\n" not in str(error.value) and "data.repeats" in str(error.value) and "from 1" in str(error.value)
    with pytest.raises(ConfigError) as error:
        build_config(overrides=["data.repeats=2", "data.name=webdataset", "data.urls=/x/{0..1}.tar"])
    assert error_lines(str(error.value)) == [str(error.value)] and "streams its samples" in str(error.value)
