"""Every bundled recipe trains: a few batches on a tiny slice of its own dataset, with
its own model and every algorithm it enables (the recipe's settings otherwise kept)."""

import json
import warnings

import pytest

from helpers import PUBLISHED_RECIPES
from slipstream.config.recipes import bundled
from slipstream.config.schema import build_config
from slipstream.run.build import build_trainer


# The published ImageNet recipes need the user's data: test_published_recipes.py trains
# each on a JPEG folder at toy scale.
@pytest.mark.parametrize("name", sorted(set(bundled()) - set(PUBLISHED_RECIPES)))
def test_bundled_recipe_trains(name, tmp_path):
    shrink = [
        "data.train_size=32",
        "data.val_size=16",
        "data.batch_size=8",
        "trainer.max_duration=4ba",
        "trainer.eval_interval=4ba",
        "trainer.progress_bar=false",
        f"trainer.run_dir={tmp_path / name}",
    ]
    cfg = build_config(name, None, shrink)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. a curriculum that cannot finish in 4 batches
        build_trainer(cfg, label=name, verbose=False).fit()
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["batches"] == 4
    assert 0.0 <= summary["accuracy"] <= 1.0
    assert sorted(a["name"] for a in summary["algorithms"]) == sorted(cfg.algorithms)
