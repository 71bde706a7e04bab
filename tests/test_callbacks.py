"""Callbacks, the second kind of plugin: discovery and config like algorithms, the
log_metrics hook, observe-only, and what a run records of them."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from helpers import fake_distribution, train
from slipstream import (
    Algorithm,
    Callback,
    ConfigError,
    Duration,
    PluginError,
    RunDir,
    State,
    hookimpl,
    load_checkpoint,
)
from slipstream.config.schema import build_config
from slipstream.plugins.discovery import CALLBACKS_GROUP, discover, instantiate
from slipstream.services.metrics import MetricsLogger


class Recorder(Callback):
    """Keeps every record log_metrics hands it, and what it saw at fit_end."""

    name = "recorder"

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self.records: list[dict] = []
        self.summary_at_fit_end: dict | None = None

    @hookimpl
    def log_metrics(self, state, record):
        self.records.append(record)

    @hookimpl
    def fit_end(self, state):
        path = RunDir(state.run_dir).summary
        self.summary_at_fit_end = json.loads(path.read_text()) if path.is_file() else None


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_log_metrics_gets_exactly_what_metrics_jsonl_gets(tmp_path):
    recorder = Recorder()
    trainer = train(tmp_path, callbacks=[recorder], max_duration="2ep", log_interval=2)
    written = read_jsonl(trainer.paths.metrics)
    assert recorder.records == written
    kinds = [r["kind"] for r in written]
    assert kinds.count("train") == 4 and kinds.count("eval") == 2  # 8 batches, every 2; 2 epochs


def test_log_metrics_is_fired_only_by_the_writing_rank(tmp_path):
    class Hooks:
        def __init__(self):
            self.records = []

        def log_metrics(self, state, record):
            self.records.append(record)

    model = torch.nn.Linear(2, 2)
    for write in (False, True):
        hooks = Hooks()
        state = State(model, torch.optim.SGD(model.parameters(), lr=0.1), Duration.parse("1ba"))
        logger = MetricsLogger(tmp_path / str(write), 1, write=write, hooks=hooks)
        (tmp_path / str(write)).mkdir()
        logger.fit_start(state)
        state.eval_metrics = {"loss": 1.0, "accuracy": 0.5}
        logger.eval_start(state)
        logger.eval_end(state)
        logger.close()
        assert [r.get("accuracy") for r in hooks.records] == ([0.5] if write else [])


def test_callbacks_observe_last_and_are_recorded_apart_from_algorithms(tmp_path):
    recorder = Recorder()
    trainer = train(tmp_path, callbacks=[recorder], max_duration="1ep")
    # At fit_end the engine has already written summary.json: callbacks are called after it.
    assert recorder.summary_at_fit_end is not None
    assert recorder.summary_at_fit_end["status"] == "completed"
    summary = json.loads(trainer.paths.summary.read_text())
    assert summary["algorithms"] == []
    assert [c["name"] for c in summary["callbacks"]] == ["recorder"]
    assert set(summary["callbacks"][0]) >= {"name", "version", "config"}
    assert "recorder" in trainer.config["callbacks"]


class ReplacesForward(Callback):
    name = "sneaky"

    @hookimpl
    def forward(self, state):
        return state.model(state.batch[0])


class WrapsBackward(Callback):
    name = "wrapper"

    @hookimpl(wrapper=True)
    def backward(self, state):
        return (yield)


@pytest.mark.parametrize("callback, step", [(ReplacesForward(), "forward"), (WrapsBackward(), "backward")])
def test_a_callback_may_not_implement_a_step_hook(tmp_path, callback, step):
    with pytest.raises(PluginError, match=rf"callback '{callback.name}' .* implements the step hook '{step}'"):
        train(tmp_path, callbacks=[callback])
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_names_are_checked_like_algorithms(tmp_path):
    with pytest.raises(PluginError, match="unknown callback 'early_stoping'.*did you mean 'early_stopping'"):
        train(tmp_path, callbacks=["early_stoping"])
    with pytest.raises(PluginError, match="installed callbacks: .*tensorboard"):
        train(tmp_path, callbacks=["nothing_like_it"])
    with pytest.raises(PluginError, match="not a Callback instance"):
        train(tmp_path, callbacks=[Algorithm()])
    with pytest.raises(PluginError, match="enabled twice"):
        train(tmp_path, callbacks=[Recorder(), Recorder()])

    class Clash(Algorithm):
        name = "recorder"

    with pytest.raises(PluginError, match="has the name of an algorithm"):
        train(tmp_path, [Clash()], callbacks=[Recorder()])


def test_a_callback_by_name_is_built_with_its_default_config(tmp_path):
    trainer = train(tmp_path, callbacks=["early_stopping"], max_duration="1ep")
    assert trainer.callbacks[0].config.patience == 3
    # Its state is in the checkpoint, under its name, as an algorithm's would be.
    saved = load_checkpoint(trainer.paths.latest)["plugins"]["early_stopping"]
    assert saved["state"]["best"] == trainer.summary["accuracy"]


def test_an_algorithm_is_not_a_callback_and_the_groups_are_apart():
    callbacks = discover(load=False, group=CALLBACKS_GROUP)
    assert {"early_stopping", "tensorboard", "mlflow", "wandb", "profiler"} <= set(callbacks)
    assert "ema" not in callbacks and "early_stopping" not in discover(load=False)


BAD_CALLBACK = '''
from slipstream import Algorithm

class NotACallback(Algorithm):
    """An algorithm registered in the wrong group."""
    name = "misfiled"
'''


def test_an_algorithm_registered_as_a_callback_is_a_load_error(tmp_path, monkeypatch):
    # mlflow and wandb import importlib_metadata, whose finder then answers first and
    # raises KeyError for a missing Summary: discovery must not depend on which is loaded.
    pytest.importorskip("importlib_metadata")
    site = fake_distribution(tmp_path / "site", "slipstream-misfiled", {}, {"misfiled_mod": BAD_CALLBACK})
    info = next(site.glob("*.dist-info"))
    (info / "entry_points.txt").write_text("[slipstream.callbacks]\nmisfiled = misfiled_mod:NotACallback\n")
    monkeypatch.syspath_prepend(str(site))
    found = discover(group=CALLBACKS_GROUP)
    assert found["misfiled"].error == "misfiled_mod:NotACallback is not a subclass of slipstream.Callback"
    with pytest.raises(PluginError, match="callback 'misfiled' .* failed to load"):
        instantiate({"misfiled": None}, found, CALLBACKS_GROUP)


# -- configuration: --callbacks, a recipe's callbacks:, dotted overrides ---------------


def test_callbacks_merge_like_algorithms(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("callbacks:\n  early_stopping: {patience: 2}\n  profiler: {}\n")
    cfg = build_config(recipe, None, ["callbacks.early_stopping.min_delta=0.01"], callbacks="tensorboard,no:profiler")
    assert dict(cfg.callbacks) == {
        "early_stopping": {"patience": 2, "min_delta": 0.01},
        "tensorboard": {},
    }
    assert dict(cfg.algorithms) == {}
    # A dotted option enables the callback; =false/null removes it.
    assert "wandb" in build_config(None, None, ["callbacks.wandb.project=p"]).callbacks
    assert "early_stopping" not in build_config(recipe, None, ["callbacks.early_stopping=false"]).callbacks


def test_callback_config_errors_name_the_callback_and_the_key():
    cls = discover(group=CALLBACKS_GROUP)["early_stopping"].cls
    from slipstream.plugins.discovery import plugin_config

    unknown = r"callbacks.early_stopping: unknown key 'patiense' \(did you mean 'patience'\?\)"
    with pytest.raises(ConfigError, match=unknown):
        plugin_config(cls, {"patiense": 2})
    # Any metric name (the run refuses one it does not evaluate: tests/test_metrics.py); not an empty one.
    monitor = r"callbacks.early_stopping: monitor must name an evaluated metric \(accuracy, loss, ...\), got ''"
    with pytest.raises(ConfigError, match=monitor):
        plugin_config(cls, {"monitor": ""})


def test_removing_a_callback_that_is_not_there():
    typo = r"--callbacks no:tensorbord: no callback 'tensorbord' is installed \(did you mean 'tensorboard'\?\)"
    with pytest.raises(ConfigError, match=typo):
        build_config(None, None, [], callbacks="no:tensorbord")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_config(None, None, [], callbacks="no:tensorboard")
    assert any("removes nothing: 'tensorboard' is not enabled" in str(w.message) for w in caught)
