"""Issue 42: the four published ImageNet recipes, at toy scale. Each trains on a small
JPEG ImageFolder (the real loading code, photo-shaped images) with a tiny model of its
family for a few batches, and every piece it sets shows its effect: the optimizer and
loss it names, its train and test resolutions, and each algorithm's probe (the ones the
compatibility matrix uses). The recipes' ImageNet values are checked against the papers
by reading them (their comments cite each); here only what must be scaled to a few
batches is changed, each change listed in TOY."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from compat_setup import PROBES
from helpers import PUBLISHED_RECIPES as PUBLISHED
from slipstream import Algorithm, hookimpl
from slipstream.cli.compatibility import Observed, _Recorder
from slipstream.config.recipes import bundled
from slipstream.config.schema import build_config
from slipstream.run.build import build_trainer

TRAIN, EVAL = 32, 40  # the toy's training and test resolutions (as 160/176 -> 224)

# What a few batches need instead of a few hundred epochs, per recipe key (where set).
TOY = {
    "algorithms.stepwise_lr.warmup": "1ep",  # 5-8 epochs of warm-up: 1 of the toy's 2
    "algorithms.sam.interval": 2,  # every 10th step: every 2nd of 6
    "algorithms.ema.half_life": "2ba",  # 100 batches
    "algorithms.ema.update_every": 1,  # 20 batches
    "algorithms.mixed_precision.dtype": "bf16",  # auto: fp32 on a CPU without bf16 units
    "algorithms.channels_last.mode": "always",
}
MODELS = {"cnn": ["model.name=test_resnet", "model.kwargs={}"],
          "vit": ["model.name=test_vit", "model.kwargs={patch_size: 8}"]}  # fmt: skip


def photo(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    w, h = 64, 48
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([x * 255 / w, y * 255 / h, np.full_like(x, rng.integers(0, 255))], axis=-1)
    return Image.fromarray(np.clip(rgb + rng.normal(0, 20, rgb.shape), 0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("imagenet_like")
    for split, count in (("train", 24), ("val", 8)):
        for i in range(count):
            folder = root / split / f"n0{i % 4}"
            folder.mkdir(parents=True, exist_ok=True)
            photo(i + (100 if split == "val" else 0)).save(folder / f"{i:02d}.jpg", quality=90)
    return root


class _Losses(Algorithm):
    """The loss the step used beside the run's plain loss on the same outputs and targets
    (label_smoothing swaps the loss function for the step only)."""

    name = "recipe_losses"

    def __init__(self) -> None:
        super().__init__()
        self.pairs: list[tuple[float, float]] = []

    @hookimpl
    def after_loss(self, state) -> None:
        plain = state.loss_fn(state.outputs.detach().float(), state.batch[1])
        self.pairs.append((float(state.loss.detach()), float(plain)))


def train_toy(name: str, tree: Path, run_dir: Path):
    recipe = build_config(name, None, [])
    kind = "vit" if "vit" in recipe.model.name or "deit" in recipe.model.name else "cnn"
    toy = [f"{k}={v}" for k, v in TOY.items() if _is_set(recipe, k)]
    cfg = build_config(name, None, [
        f"data.root={tree}", f"data.image_size={TRAIN}", f"data.eval_image_size={EVAL}",
        "data.batch_size=8", "data.eval_batch_size=8", "data.num_workers=0", "data.persistent_workers=false",
        "trainer.max_duration=6ba", "trainer.eval_interval=6ba", "trainer.progress_bar=false",
        "trainer.threads=1", f"trainer.run_dir={run_dir}", *MODELS[kind], *toy,
    ])  # fmt: skip
    trainer = build_trainer(cfg, label=name, verbose=False)
    seen, losses = Observed(), _Losses()
    trainer.pm.register(_Recorder(seen, trainer.normalize), name=_Recorder.name)
    trainer.pm.register(losses, name=losses.name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit()
    seen.summary = dict(trainer.summary)
    return recipe, cfg, trainer, seen, losses


def _is_set(cfg, key: str) -> bool:
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key, default=None) is not None


def _grows(seen: Observed) -> str | None:
    sizes = [s[-1] for s in seen.input_shapes]
    return None if sizes[0] < sizes[-1] and sizes == sorted(sizes) else f"input sizes {sizes}"


def _dropped(seen: Observed) -> str | None:
    shrunk = all(s[-1] < r[-1] for s, r in zip(seen.input_shapes, seen.raw_shapes, strict=True))
    return None if shrunk else "nothing dropped"


# The compatibility matrix's probes, but for the pieces whose probe compares the test
# resolution with the training one (here they differ on purpose).
RECIPE_PROBES = {**PROBES, "image_size_curriculum": _grows, "colout": _dropped}


def test_the_published_recipes_are_bundled_and_cite_their_sources():
    for name in PUBLISHED:
        text = bundled()[name].read_text()
        assert "Source:" in text, name
        assert build_config(name, None, []).data.root is None, f"{name}: the data path is the user's"


@pytest.mark.parametrize("name", PUBLISHED)
def test_a_published_recipe_trains_at_toy_scale_with_every_piece_showing(name, tree, tmp_path):
    recipe, cfg, trainer, seen, losses = train_toy(name, tree, tmp_path / name)
    assert seen.summary["status"] == "completed" and seen.batches == 6
    # The data pieces: crops from the whole photo at the training size, the test at its own.
    # (A curriculum tells the loader its size: its batches come cut smaller, then grow.)
    loaded = {s[-2:] for s in seen.raw_shapes}
    assert max(loaded) == (TRAIN, TRAIN) and ("image_size_curriculum" in recipe.algorithms or len(loaded) == 1)
    assert {s[-2:] for s in seen.eval_shapes} == {(EVAL, EVAL)}
    assert cfg.data.train_crop == "random_resized" and cfg.data.crop_pct == recipe.data.crop_pct
    # The optimizer and loss the recipe names, with its values.
    opt = trainer.state.optimizer
    expected_opt = {"lamb": "Lamb", "adamw": "AdamW", "sgdw": "SGDW"}[recipe.optimizer.name]
    assert type(opt).__name__ == expected_opt
    assert max(g["weight_decay"] for g in opt.param_groups) == recipe.optimizer.weight_decay
    assert ("BinaryCrossEntropy" in type(trainer.state.loss_fn).__name__) == (recipe.loss.name == "bce")
    # Every algorithm it enables shows its effect.
    for algorithm in recipe.algorithms:
        if algorithm == "label_smoothing":
            assert any(abs(a - b) > 1e-4 for a, b in losses.pairs), "the loss is the plain loss"
            continue
        missing = RECIPE_PROBES[algorithm](seen)
        assert missing is None, f"{name}: {algorithm} shows no effect: {missing}"
    if recipe.data.repeats > 1:
        indices = list(trainer.state.train_loader.sampler)
        assert len(set(indices)) < len(indices), "no sample repeated"

