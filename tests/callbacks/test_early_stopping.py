"""early_stopping: ends a run whose eval metric stopped improving, with status
stopped_early (exit code 0), and leaves an improving run alone."""

from __future__ import annotations

import pytest
from slipstream_early_stopping import EarlyStopping, EarlyStoppingConfig, improved

from helpers import ConstantMetric, ScriptedMetric, train
from slipstream import ConfigError, load_checkpoint
from slipstream.cli.main import exit_code

PLATEAU = [0.5, 0.6, 0.6, 0.55, 0.6, 0.7, 0.8, 0.9]  # no gain after the 2nd evaluation for a while


def test_stops_when_the_metric_stops_improving(tmp_path):
    # One evaluation per batch: the 5th evaluation is the 3rd without a gain.
    stopper = EarlyStopping(EarlyStoppingConfig(patience=3))
    trainer = train(
        tmp_path, [ScriptedMetric(PLATEAU)], callbacks=[stopper], max_duration="4ep", eval_interval="1ba"
    )
    summary = trainer.summary
    assert summary["status"] == "stopped_early" and exit_code(summary) == 0
    assert summary["batches"] == 5  # not the 16 of 4 epochs
    assert "has not improved" in summary["stop_reason"] and "best 0.6 at step 2" in summary["stop_reason"]
    assert summary["early_stopping"] == {"monitor": "accuracy", "best": 0.6, "best_step": 2, "stopped_step": 5}
    assert load_checkpoint(trainer.paths.latest)["plugins"]["early_stopping"]["state"]["waited"] == 3


def test_does_not_stop_with_a_large_patience(tmp_path):
    stopper = EarlyStopping(EarlyStoppingConfig(patience=4))
    trainer = train(
        tmp_path, [ScriptedMetric(PLATEAU)], callbacks=[stopper], max_duration="2ep", eval_interval="1ba"
    )
    assert trainer.summary["status"] == "completed" and trainer.summary["batches"] == 8
    assert "stop_reason" not in trainer.summary


def test_min_delta_and_loss_mode(tmp_path):
    # Loss falls by 0.005 per evaluation: an improvement, unless min_delta asks for 0.01.
    losses = [1.0 - 0.005 * i for i in range(20)]
    stopper = EarlyStopping(EarlyStoppingConfig(monitor="loss", patience=2, min_delta=0.01))
    assert stopper.config.mode == "min"
    trainer = train(
        tmp_path / "a", [ScriptedMetric(losses, "loss")], callbacks=[stopper], max_duration="2ep", eval_interval="1ba"
    )
    assert trainer.summary["status"] == "stopped_early" and trainer.summary["batches"] == 3
    trainer = train(
        tmp_path / "b",
        [ScriptedMetric(losses, "loss")],
        callbacks=[EarlyStopping(EarlyStoppingConfig(monitor="loss", patience=2))],
        max_duration="2ep",
        eval_interval="1ba",
    )
    assert trainer.summary["status"] == "completed"


def test_improved_and_config_checks():
    assert improved(0.7, 0.6, "max", 0.05) and not improved(0.62, 0.6, "max", 0.05)
    assert improved(0.5, 0.6, "min", 0.0) and not improved(0.6, 0.6, "min", 0.0)
    assert EarlyStoppingConfig(monitor="accuracy").mode == "max"
    with pytest.raises(ValueError, match="patience must be a whole number >= 1"):
        EarlyStoppingConfig(patience=0)
    with pytest.raises(ValueError, match="mode must be one of max, min"):
        EarlyStoppingConfig(mode="up")


class Errors(ConstantMetric):
    """A metric of one's own, lower better (its values scripted by ScriptedMetric)."""

    name = "errors"
    higher_is_better = False


def test_any_evaluated_metric_is_monitored_in_its_plugins_direction(tmp_path):
    falling = [0.9 - 0.1 * i for i in range(8)]  # better every time, as errors (lower is better)
    config = EarlyStoppingConfig(monitor="errors", patience=2)
    assert config.mode is None  # not one of the engine's: the direction comes with the run's metric
    stopper = EarlyStopping(config)
    trainer = train(
        tmp_path / "a", [ScriptedMetric(falling, "errors")], callbacks=[stopper], max_duration="1ep",
        eval_interval="1ba", metrics=["loss", Errors], best_metric="errors",
    )  # fmt: skip
    assert stopper.monitor_higher is False and trainer.summary["status"] == "completed"
    # The same values read as higher-better (mode given) stop at the 3rd evaluation.
    stopper = EarlyStopping(EarlyStoppingConfig(monitor="errors", patience=2, mode="max"))
    trainer = train(
        tmp_path / "b", [ScriptedMetric(falling, "errors")], callbacks=[stopper], max_duration="1ep",
        eval_interval="1ba", metrics=["loss", Errors], best_metric="errors",
    )  # fmt: skip
    assert trainer.summary["status"] == "stopped_early" and trainer.summary["batches"] == 3
    with pytest.raises(ConfigError, match="callbacks.early_stopping.monitor='f1_macro' is not evaluated"):
        train(tmp_path / "c", callbacks=[EarlyStopping(EarlyStoppingConfig(monitor="f1_macro"))], eval_interval="1ba")
