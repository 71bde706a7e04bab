"""Time to a target accuracy, and stopping there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import train
from slipstream import ConfigError
from slipstream.config.schema import build_config


def eval_records(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return [r for r in records if r["kind"] == "eval"]


def test_stop_at_target_ends_the_run_there(tmp_path: Path) -> None:
    # The toy problem passes 30 % within a few epochs; 8 epochs would be 32 batches.
    trainer = train(tmp_path, max_duration="8ep", target_accuracy=0.3, stop_at_target=True)
    summary = trainer.summary
    evals = eval_records(tmp_path / "run")
    first = next(r for r in evals if r["accuracy"] >= 0.3)
    assert summary["status"] == "target_reached"
    assert summary["target_accuracy"] == 0.3
    assert summary["time_to_target_s"] == first["elapsed_s"]
    # Nothing after the record that reached it: the run ended at that batch.
    assert evals[-1]["step"] == first["step"] == summary["batches"] < 32


def test_without_stop_the_run_goes_on_and_records_the_time(tmp_path: Path) -> None:
    trainer = train(tmp_path, max_duration="8ep", target_accuracy=0.3)
    summary = trainer.summary
    evals = eval_records(tmp_path / "run")
    first = next(r for r in evals if r["accuracy"] >= 0.3)
    assert summary["status"] == "completed" and summary["batches"] == 32
    assert summary["time_to_target_s"] == first["elapsed_s"] < evals[-1]["elapsed_s"]


def test_a_target_never_reached_is_null(tmp_path: Path) -> None:
    trainer = train(tmp_path, lr=1e-9, target_accuracy=1.0, stop_at_target=True)
    assert trainer.summary["status"] == "completed"
    assert trainer.summary["time_to_target_s"] is None
    assert train(tmp_path / "none").summary["target_accuracy"] is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.target_accuracy=90"], r"fraction in \(0, 1\]"),
        (["trainer.target_accuracy=0"], r"fraction in \(0, 1\]"),
        (["trainer.stop_at_target=true"], "needs (trainer.)?target_accuracy"),
    ],
)
def test_bad_target_settings_are_clear_errors(tmp_path, overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(None, None, overrides)
    options = {k.split(".")[1]: v for k, v in (o.split("=") for o in overrides)}
    typed = {k: (v == "true" if k == "stop_at_target" else float(v)) for k, v in options.items()}
    with pytest.raises(ConfigError, match=message):
        train(tmp_path, **typed)
