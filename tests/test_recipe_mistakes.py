"""Recipes and overrides as a CLI user writes them (session 20's walkthrough): what they
say is what trains, or one line says why not."""

from __future__ import annotations

import warnings

import pytest
import torch

from slipstream.cli import main as cli_main
from slipstream.config.recipes import bundled, description
from slipstream.config.schema import build_config
from slipstream.errors import ConfigError, ConfigWarning, network_failure
from slipstream.optim import build_optimizer


def _recipe(tmp_path, text: str, name: str = "mine.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_recipe_removes_an_inherited_algorithm_with_false_and_enables_one_with_true_or_nothing(tmp_path):
    path = _recipe(tmp_path, "extends: default\nalgorithms:\n  stepwise_lr: false\n  ema: true\n  mixup:\n")
    algorithms = build_config(path).algorithms
    assert "stepwise_lr" not in algorithms and {"ema", "mixup"} <= set(algorithms)
    assert dict(algorithms["ema"]) == {}
    none = _recipe(tmp_path, "extends: default\nalgorithms: {}\n", "none.yaml")
    assert list(build_config(none).algorithms) == []
    with pytest.warns(ConfigWarning, match="algorithms.ema: false removes nothing: default does not enable 'ema'"):
        build_config(_recipe(tmp_path, "extends: default\nalgorithms:\n  ema: false\n", "nothing.yaml"))


@pytest.mark.parametrize("empty", ["algorithms={}", "algorithms=null", "callbacks={}", "callbacks=null"])
def test_an_emptied_plugin_section_on_the_command_line_takes_none_of_the_recipes(tmp_path, empty):
    # Issue 44, case 4: `'algorithms={}'` and `algorithms=null` were ignored (the recipe's ran).
    section = empty.split("=")[0]
    recipe = _recipe(tmp_path, "extends: default\ncallbacks:\n  early_stopping: {}\n")
    assert list(build_config(recipe)[section])  # the recipe enables some
    assert list(build_config(recipe, overrides=[empty])[section]) == []
    assert list(build_config(recipe, algorithms="ema", callbacks="profiler", overrides=[empty])[section]) == []


def test_the_command_line_switches_the_dataset_of_a_recipe_and_unsets_its_keys(tmp_path):
    """Issue 44, case 8: over a WebDataset recipe, `data.name=huggingface data.path=P` was
    refused ("data.urls is not read by data.name=huggingface"), and so was `data.urls=null`:
    no way out. Now the recipe's webdataset keys go, with one warning naming them."""
    recipe = _recipe(tmp_path, "extends: default\ndata:\n  name: webdataset\n  urls: /shards/train-{0..9}.tar\n"
                     "  eval_urls: /shards/val-0.tar\n  shuffle_block: 64\n")  # fmt: skip
    with pytest.warns(ConfigWarning, match=r"data.urls, data.eval_urls, data.shuffle_block dropped: only "
                      r"data.name=webdataset reads them, and the command line sets data.name=huggingface"):  # fmt: skip
        data = build_config(recipe, overrides=["data.name=huggingface", "data.path=/hf"]).data
    assert data.name == "huggingface" and data.path == "/hf" and "urls" not in data and "eval_urls" not in data
    # key=null unsets a dataset's key, as leaving it out of the recipe would.
    assert "eval_urls" not in build_config(recipe, overrides=["data.eval_urls=null"]).data
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data = build_config(recipe, overrides=["data.urls=null", "data.eval_urls=null", "data.shuffle_block=null",
                                               "data.name=huggingface", "data.path=/hf"]).data  # fmt: skip
    assert "urls" not in data and data.name == "huggingface"
    # A key of the recipe's dataset that the command line itself sets is still refused by name.
    with pytest.raises(ConfigError, match="data.urls is not read by data.name=huggingface"):
        build_config(recipe, overrides=["data.name=huggingface", "data.path=/hf", "data.urls=/x.tar",
                                        "data.eval_urls=null", "data.shuffle_block=null"])  # fmt: skip


def test_a_scalar_for_a_plugin_in_a_recipe_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="algorithms.ema is 5; give its options as a mapping, true or nothing"):
        build_config(_recipe(tmp_path, "extends: default\nalgorithms:\n  ema: 5\n"))


def test_an_empty_mapping_replaces_an_inherited_one(tmp_path):
    assert dict(build_config("resnet18_fast").model.kwargs)  # the parent's constructor arguments
    assert dict(build_config("resnet18_fast", overrides=["model.kwargs={}"]).model.kwargs) == {}
    child = _recipe(tmp_path, "extends: resnet18_fast\nmodel:\n  kwargs: {}\n")
    assert dict(build_config(child).model.kwargs) == {}
    merged = build_config("resnet18_fast", overrides=["model.kwargs.stem_width=8"]).model.kwargs
    assert merged["stem_width"] == 8 and "channels" in merged  # a key is still merged in


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.pin_memory=2", "data.pin_memory is true or false, got 2"),
        ("trainer.autotune=0", "trainer.autotune is true or false, got 0"),
        ("trainer.ddp.static_graph=3", "trainer.ddp.static_graph is true or false, got 3"),
        ("trainer.ddp=5", "trainer.ddp is a section of keys, not 5; set one as trainer.ddp."),
        ("trainer.ddp.static_grap=true", "unknown key 'trainer.ddp.static_grap' (did you mean 'trainer.ddp.static_g"),
        ("optimizer.betas=0.9", "optimizer.betas is a list, got 0.9"),
        ("trainer.load_ignore_keys=fc.*", "trainer.load_ignore_keys is a list, got 'fc.*'"),
        ("model.kwargs=5", "model.kwargs is a mapping of keywords, got 5"),
        ("optimizer.weight_decay=-1", "optimizer.weight_decay must be 0 or more, got -1.0"),
    ],
)
def test_values_of_the_wrong_shape_are_named_in_the_users_words(override, message):
    with pytest.raises(ConfigError) as caught:
        build_config("default", overrides=[override])
    assert message in str(caught.value)


def test_an_optimizer_keyword_it_does_not_take_is_a_config_error():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="cannot build optimizer 'adamw' with optimizer.kwargs=\\{'foo': 1\\}"):
        build_optimizer(model, "adamw", 1e-3, kwargs={"foo": 1})


def test_a_bare_name_is_the_bundled_recipe_even_beside_a_file_of_that_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _recipe(tmp_path, "model: {name: test_resnet}\n", "default.yaml")
    with pytest.warns(ConfigWarning, match="recipe 'default' is the bundled one, not the file default.yaml"):
        assert build_config("default").model.name == "resnet10t"
    assert build_config("./default.yaml").model.name == "test_resnet"
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        build_config("resnet18_fast")  # extends a bundled sibling: no warning


def test_a_recipes_description_is_its_first_whole_sentence():
    text = description(bundled()["resnet18_fast"])
    assert text.endswith(".") and text.startswith("The baseline with")


def test_a_reader_that_goes_away_is_no_network_failure(monkeypatch, capsys):
    assert network_failure(BrokenPipeError(32, "Broken pipe")) is None

    def piped(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setitem(cli_main._COMMANDS, "recipes", piped)
    assert cli_main.main(["recipes"]) == 0
    assert capsys.readouterr().err == ""
