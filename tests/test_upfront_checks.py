"""Mistakes found before anything is written: one line, exit 2, no run or sweep
directory; settings that would do nothing are warnings (issue 27)."""

from __future__ import annotations

import pytest

from helpers import TINY_RUN, error_lines
from slipstream.cli.main import main
from slipstream.config.schema import build_config
from slipstream.errors import ConfigWarning

TINY = [*TINY_RUN, "trainer.max_duration=1ba"]
LR = "optimizer.lr=uniform(0.1,0.2)"


def _one_line_exit_2(code, capsys, *fragments):
    err = error_lines(capsys.readouterr().err)
    assert code == 2 and len(err) == 1, err
    for fragment in fragments:
        assert fragment in err[0], err


@pytest.mark.parametrize("plugin", ["mixup", "cutmix"])
def test_a_mixing_plugins_class_count_must_match_the_model(tmp_path, capsys, plugin):
    run_dir = tmp_path / "run"
    overrides = [f"algorithms.{plugin}.num_classes=3", f"trainer.run_dir={run_dir}"]
    code = main(["train", "-q", "-a", plugin, *TINY, *overrides])
    _one_line_exit_2(code, capsys, f"algorithms.{plugin}.num_classes=3", "the model has 10 classes")
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        (["optimizer.name=choice(sgd,nosuchopt)"], "optimizer.name 'nosuchopt' is not supported"),
        (
            ["algorithms.label_smoothing.smoothing=choice(0.1,2.0)"],
            "algorithms.label_smoothing: smoothing must be a finite number in [0, 1)",
        ),
        (["--pruner-startup-trials", "-1", LR], "--pruner-startup-trials must be 0 or more"),
        (["--metric", "accuracy_top5", "data.num_classes=3", LR], "needs at least 5 classes"),
    ],
)
def test_a_sweep_checks_every_value_and_argument_before_its_directory(tmp_path, capsys, arguments, fragment):
    sweep_dir = tmp_path / "sweep"
    code = main(["sweep", "--trials", "1", "--sweep-dir", str(sweep_dir), *arguments])
    _one_line_exit_2(code, capsys, fragment)
    assert not sweep_dir.exists()


@pytest.mark.parametrize(
    ("overrides", "callbacks", "warning"),
    [
        (["trainer.eval_interval=null", "trainer.best_metric=loss"], None, "trainer.best_metric is ignored"),
        (["trainer.eval_interval=null", "trainer.target_accuracy=0.5"], None, "target_accuracy is never reached"),
        (["trainer.eval_interval=null"], "early_stopping", "early_stopping never stops the run"),
        (["trainer.max_duration=4ba", "trainer.eval_interval=4ba"], "early_stopping",
         "early_stopping never stops the run: trainer.eval_interval=4ba evaluates only at its end"),
        (["data.name=webdataset", "data.urls=a.tar", "data.num_workers=2", "data.persistent_workers=true"], None,
         "data.persistent_workers is ignored with data.name=webdataset"),
        (["data.num_classes=3", "trainer.best_metric=accuracy_top5"], None, "3 classes (< 5)"),
    ],
)
def test_a_setting_that_would_do_nothing_is_a_warning(overrides, callbacks, warning):
    with pytest.warns(ConfigWarning, match=warning.replace("(", r"\(").replace(")", r"\)")):
        build_config("default", None, overrides, callbacks=callbacks)


def test_a_master_port_in_use_is_one_line_before_anything_starts(tmp_path, capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        run_dir = tmp_path / "run"
        code = main(
            ["train", "--nproc-per-node", "2", "--master-port", str(port), *TINY, f"trainer.run_dir={run_dir}"]
        )
    _one_line_exit_2(code, capsys, f"--master-port {port} is already in use")
    assert not run_dir.exists()


def test_an_online_logger_without_credentials_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    run_dir = tmp_path / "run"
    online = ["callbacks.wandb.mode=online", f"trainer.run_dir={run_dir}"]
    code = main(["train", "-q", "--callbacks", "wandb", *TINY, *online])
    _one_line_exit_2(code, capsys, "mode online needs a W&B API key")
    assert not run_dir.exists()


def test_a_one_pass_iterator_cannot_train_two_epochs(tmp_path):
    import torch

    from helpers import tiny_loaders, tiny_model
    from slipstream import ConfigError, Trainer

    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = tiny_loaders()[0]  # 4 batches

    def run(data, max_duration):
        return Trainer(model, optimizer, data, max_duration=max_duration, run_dir=tmp_path / max_duration,
                       progress_bar=False, verbose=False, eval_interval=None)

    with pytest.raises(ConfigError, match=r"one-pass iterator \(generator\).*max_duration=2ep needs 2"):
        run((b for b in loader), "2ep")
    assert not (tmp_path / "2ep").exists()  # refused before anything is written
    with pytest.raises(ConfigError, match="no batches in epoch 1, after 4 before it: it can be read only once"):
        run(iter(loader), "6ba").fit()  # found at the second pass: it was not asked for in epochs
    assert run(iter(loader), "1ep").fit()["status"] == "completed"  # one pass is fine


def test_an_optimizer_that_does_not_hold_the_models_parameters_is_named(tmp_path):
    import copy
    import warnings

    import torch

    from helpers import tiny_loaders, tiny_model
    from slipstream import ConfigError, Trainer

    def build(model, optimizer, name):
        return Trainer(model, optimizer, tiny_loaders()[0], max_duration="2ba", run_dir=tmp_path / name,
                       progress_bar=False, verbose=False, eval_interval=None)

    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="holds none of the model's parameters, so nothing would train"):
        build(copy.deepcopy(model), optimizer, "copy")
    assert not (tmp_path / "copy").exists()
    # A head replaced after the optimizer was built: trained by nobody, and said so.
    model.fc = torch.nn.Linear(model.fc.in_features, 4)
    missing = r"2 of the model's trainable parameters are not in the optimizer \(fc.weight, fc.bias\)"
    with pytest.warns(UserWarning, match=missing):
        build(model, optimizer, "head")
    # Frozen on purpose: nothing to say.
    for p in model.fc.parameters():
        p.requires_grad_(False)
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        build(model, optimizer, "frozen")
    assert not [w for w in told if "not in the optimizer" in str(w.message)]


def test_what_needs_evaluation_is_named_when_there_is_no_eval_data(tmp_path):
    import warnings

    import torch

    from helpers import tiny_loaders, tiny_model
    from slipstream import Trainer

    model = tiny_model()
    train_data, eval_data = tiny_loaders()

    def told(**kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data, run_dir=tmp_path / "run",
                    progress_bar=False, verbose=False, **kwargs)
        return [str(w.message) for w in caught if "no evaluation" in str(w.message)]

    assert told(callbacks=["early_stopping"], target_accuracy=0.9) == [
        "slipstream: target_accuracy=0.9 is never reached: no eval_data, so no evaluation",
        "slipstream: the early_stopping callback never stops the run: no eval_data, so no evaluation",
    ]
    assert told(callbacks=["early_stopping"], target_accuracy=0.9, eval_data=eval_data) == []
    assert told() == []


@pytest.mark.parametrize(
    "swap, fragment",
    [
        ({"model": lambda x: x}, "model must be a torch.nn.Module, got function"),
        ({"optimizer": None}, "optimizer must be a torch.optim.Optimizer, got NoneType"),
        ({"optimizer": "SGD_CLASS"}, "got the class SGD; build it on the model's parameters, e.g. SGD("),
        ({"train_data": None}, "train_data must be an iterable of (inputs, targets) batches, such as a DataLoader"),
        ({"train_data": "DATASET"}, "train_data is a TensorDataset, a dataset of single samples; give batches"),
        ({"eval_data": "DATASET"}, "eval_data is a TensorDataset, a dataset of single samples"),
    ],
)
def test_the_trainers_objects_are_checked_in_one_line(tmp_path, swap, fragment):
    import torch

    from helpers import tiny_loaders, tiny_model
    from slipstream import ConfigError, Trainer

    model = tiny_model()
    train_data, eval_data = tiny_loaders()
    given = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "train_data": train_data,
             "eval_data": eval_data, **swap}  # fmt: skip
    for key, value in given.items():
        if value == "SGD_CLASS":
            given[key] = torch.optim.SGD
        elif value == "DATASET":
            given[key] = train_data.dataset
    with pytest.raises(ConfigError) as error:
        Trainer(**given, run_dir=tmp_path / "run", progress_bar=False, verbose=False)
    assert fragment in str(error.value)
    assert not (tmp_path / "run").exists()
