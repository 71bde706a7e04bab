"""Configuration: recipes, inheritance, merge order and clear errors."""

import os
import warnings
from pathlib import Path

import pytest

from slipstream import ConfigError, Duration, DurationError
from slipstream.config.recipes import bundled, find_recipe
from slipstream.config.schema import build_config


def write(path, text):
    path.write_text(text)
    return path


@pytest.fixture
def recipes(tmp_path):
    write(
        tmp_path / "base.yaml",
        """
model: {name: test_resnet}
data: {batch_size: 32, image_size: 24}
trainer: {max_duration: 3ep}
algorithms:
  alpha: {level: 1}
  beta: {}
""",
    )
    write(
        tmp_path / "child.yaml",
        """
extends: base.yaml
data: {batch_size: 64}
algorithms:
  alpha: {level: 2}
""",
    )
    return tmp_path


def test_defaults_without_a_recipe():
    cfg = build_config()
    assert cfg.model.name == "resnet18" and cfg.data.name == "synthetic"
    assert cfg.trainer.max_duration == "2ep" and dict(cfg.algorithms) == {}


def test_recipe_inheritance_merges_the_child_over_the_parent(recipes):
    cfg = build_config(recipes / "child.yaml")
    assert cfg.model.name == "test_resnet"  # from the parent
    assert cfg.data.batch_size == 64  # child wins
    assert cfg.data.image_size == 24
    assert cfg.algorithms.alpha.level == 2 and "beta" in cfg.algorithms


def test_merge_order_defaults_recipe_algorithms_flag_overrides(recipes):
    cfg = build_config(
        recipes / "child.yaml",
        "gamma,no:beta",
        ["data.batch_size=16", "algorithms.alpha.level=3", "algorithms.delta.x=1"],
    )
    assert cfg.data.batch_size == 16
    assert list(cfg.algorithms) == ["alpha", "gamma", "delta"]
    assert cfg.algorithms.alpha.level == 3
    assert cfg.algorithms.delta.x == 1  # a dotted option enables the algorithm


def test_a_dotted_option_inside_a_plugins_mapping_keeps_the_rest_of_it():
    """algorithms.gpu_augmentation.erasing.mode=const over a recipe's erasing mapping
    changes the mode and keeps its probability (it used to replace the whole mapping)."""
    cfg = build_config("deit_small", None, ["algorithms.gpu_augmentation.erasing.mode=const"])
    erasing = cfg.algorithms.gpu_augmentation.erasing
    assert erasing.mode == "const" and erasing.probability == 0.25 and erasing.count == 1
    assert cfg.algorithms.gpu_augmentation.rand_augment == "rand-m9-mstd0.5-inc1"


def test_algorithms_flag_adds_to_what_the_recipe_enables(recipes):
    cfg = build_config(recipes / "base.yaml", "gamma")
    assert list(cfg.algorithms) == ["alpha", "beta", "gamma"]
    assert cfg.algorithms.alpha.level == 1


def test_unknown_key_in_a_recipe_names_it_and_the_closest(recipes):
    write(recipes / "typo.yaml", "data:\n  batch_sise: 3\n")
    with pytest.raises(
        ConfigError, match=r"unknown key 'data.batch_sise' \(did you mean 'data.batch_size'\?\)"
    ):
        build_config(recipes / "typo.yaml")


def test_unknown_key_on_the_command_line():
    with pytest.raises(
        ConfigError,
        match=r"unknown key 'trainer.max_duraton' \(did you mean 'trainer.max_duration'\?\)",
    ):
        build_config(None, None, ["trainer.max_duraton=3ep"])
    with pytest.raises(ConfigError, match=r"unknown section 'trainr' \(did you mean 'trainer'\?\)"):
        build_config(None, None, ["trainr.seed=1"])


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"data.batch_size"):
        build_config(None, None, ["data.batch_size=lots"])


def test_unparseable_duration_names_the_key():
    with pytest.raises(ConfigError, match=r"trainer.max_duration: 'ten' is not a duration"):
        build_config(None, None, ["trainer.max_duration=ten"])
    with pytest.raises(ConfigError, match=r"trainer.eval_interval"):
        build_config(None, None, ["trainer.eval_interval=3 epochs"])


def test_override_without_equals_sign():
    with pytest.raises(ConfigError, match="must look like key=value"):
        build_config(None, None, ["trainer.seed"])


@pytest.mark.parametrize(
    "bad",
    [
        "trainer.max_duration=[1,",  # unterminated YAML flow
        # two overrides in one shell word: the second becomes part of the first's value
        "algorithms.gpu_augmentation.preset=custom algorithms.gpu_augmentation.custom=[{name: A},{name: B}]",
    ],
)
def test_override_with_invalid_yaml_names_the_override(bad):
    with pytest.raises(ConfigError, match=r"cannot parse override .*Values are YAML") as info:
        build_config(None, None, ["trainer.seed=1", bad])
    assert repr(bad) in str(info.value) and "trainer.seed=1" not in str(info.value)


@pytest.mark.parametrize("plain", ["trainer=5", "data=cifar10", "algorithms=ema"])
def test_an_override_setting_a_whole_section_to_a_plain_value_is_refused(plain):
    """Between two overrides of its section it used to drop the first without a word."""
    section = plain.split("=")[0]
    with pytest.raises(ConfigError, match=rf"sets the whole section '{section}' .* must be a mapping"):
        build_config(None, None, ["trainer.max_duration=1ba", plain, "trainer.seed=3"])
    # A mapping is a section's value; algorithms=null turns off the recipe's algorithms.
    cfg = build_config(None, None, ["trainer.max_duration=1ba", "trainer.seed=3", "algorithms=null"])
    assert cfg.trainer.max_duration == "1ba" and cfg.trainer.seed == 3


def test_override_values_are_yaml():
    cfg = build_config(None, None, ["algorithms.gpu_augmentation.crop_scale=[0.8, 1.0]", "trainer.seed=3"])
    assert list(cfg.algorithms.gpu_augmentation.crop_scale) == [0.8, 1.0] and cfg.trainer.seed == 3


def test_broken_yaml_is_a_clear_error(tmp_path):
    write(tmp_path / "broken.yaml", "model: {name: resnet18\ndata: [")
    with pytest.raises(ConfigError, match=r"is not valid YAML: .* at line \d+, column \d+") as info:
        build_config(tmp_path / "broken.yaml")
    assert "\n" not in str(info.value)  # one line, not PyYAML's excerpt of the file


def test_extends_of_a_missing_recipe_names_the_recipe_that_extends_it(tmp_path):
    write(tmp_path / "child.yaml", "extends: nothere\ntrainer: {seed: 1}\n")
    with pytest.raises(ConfigError, match=r"recipe .*child.yaml extends 'nothere', which cannot be found: no recipe"):
        build_config(tmp_path / "child.yaml")


def test_a_recipe_that_is_not_a_mapping(tmp_path):
    write(tmp_path / "list.yaml", "- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        build_config(tmp_path / "list.yaml")


def test_extends_cycle_is_refused(tmp_path):
    write(tmp_path / "a.yaml", "extends: b.yaml\n")
    write(tmp_path / "b.yaml", "extends: a.yaml\n")
    with pytest.raises(ConfigError, match="extends itself"):
        build_config(tmp_path / "a.yaml")


def test_missing_recipe_lists_bundled_ones():
    with pytest.raises(
        ConfigError,
        match=r"no recipe 'defualt'.*did you mean 'default'.*bundled recipes: .*default",
    ):
        build_config("defualt")


def test_bundled_recipes_are_found_from_any_directory(tmp_path):
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert find_recipe("default") == bundled()["default"]
        cfg = build_config("default")
    finally:
        os.chdir(cwd)
    assert cfg.data.name == "synthetic"


def test_every_bundled_recipe_resolves():
    for name in bundled():
        build_config(name)


VARIANTS = Path(__file__).resolve().parents[1] / "benchmarks" / "recipe_variants"


@pytest.mark.parametrize("path", sorted(VARIANTS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_measured_recipe_variant_resolves(path):
    # The README and the cards quote runs of these files: a renamed key must not leave
    # a figure that no command can reproduce.
    cfg = build_config(str(path))
    assert cfg.model.cifar_stem and cfg.data.image_size == 32


@pytest.mark.parametrize(
    "text,value,unit",
    [
        ("10ep", 10, "ep"),
        ("2000ba", 2000, "ba"),
        ("50000sp", 50000, "sp"),
        ("0.3dur", 0.3, "dur"),
        ("90s", 90, "s"),
        ("15m", 900, "s"),
        ("24h", 86400, "s"),
        ("1.5h", 5400, "s"),
        ("1e3ba", 1000, "ba"),
    ],
)
def test_durations(text, value, unit):
    d = Duration.parse(text)
    assert (d.value, d.unit) == (value, unit)


@pytest.mark.parametrize("text", ["", "10", "ep", "10 epochs", "-1ep", "1.5dur", 10])
def test_bad_durations(text):
    with pytest.raises(DurationError):
        Duration.parse(text)


def test_a_checkpoints_config_under_other_data_leaves_its_datasets_own_keys_behind():
    """eval on a held-out ImageFolder of a run trained on synthetic data: synthetic's
    sizes are neither applied nor warned about as if the user had set them."""
    base = {"data": {"name": "synthetic", "train_size": 100, "val_size": 50, "image_size": 32}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = build_config(None, None, ["data.name=imagefolder", "data.root=/data/holdout"], base=base)
    assert cfg.data.image_size == 32 and cfg.data.root == "/data/holdout"
    assert cfg.data.train_size == build_config().data.train_size  # the default, not the checkpoint's
    same = build_config(None, None, ["data.val_size=60"], base=base)  # the same data: all of it kept
    assert (same.data.train_size, same.data.val_size) == (100, 60)
