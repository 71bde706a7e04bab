"""Time to a target accuracy, and stopping there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import TINY_RUN, error_lines, tiny_loaders, train
from slipstream import ConfigError
from slipstream.cli.main import main
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
        (["trainer.target_accuracy=2", "trainer.target_metric=val/accuracy"], r"fraction in \(0, 1\]"),
        (["trainer.target_accuracy=-1", "trainer.target_metric=loss"], r"fraction in \(0, 1\]"),
    ],
)
def test_bad_target_settings_are_clear_errors(tmp_path, overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(None, None, overrides)
    options = {k.split(".")[1]: v for k, v in (o.split("=") for o in overrides)}
    kinds = {"stop_at_target": lambda v: v == "true", "target_metric": str}
    typed = {k: kinds.get(k, float)(v) for k, v in options.items()}
    with pytest.raises(ConfigError, match=message):
        train(tmp_path, **typed)


def test_a_target_on_the_loss_is_reached_at_or_below_it(tmp_path: Path) -> None:
    # Any loss is at most 10: the first evaluation reaches it (a higher-is-better reading
    # would never); 1e-9 is never reached.
    trainer = train(tmp_path, max_duration="8ep", target_accuracy=10.0, target_metric="loss", stop_at_target=True)
    first = eval_records(tmp_path / "run")[0]
    summary = trainer.summary
    assert summary["status"] == "target_reached" and summary["batches"] == first["step"] == 4
    assert summary["target_metric"] == "loss" and summary["time_to_target_s"] == first["elapsed_s"]
    never = train(tmp_path / "never", target_accuracy=1e-9, target_metric="loss").summary
    assert never["status"] == "completed" and never["time_to_target_s"] is None


def test_a_target_on_another_evaluation_set_reads_that_set(tmp_path: Path) -> None:
    _, first = tiny_loaders(image_size=16)
    _, second = tiny_loaders(image_size=16, seed=1)  # other images: other accuracies
    trainer = train(
        tmp_path, max_duration="8ep", eval_data={"val": first, "shifted": second},
        target_accuracy=0.3, target_metric="shifted/accuracy",
    )  # fmt: skip
    evals = eval_records(tmp_path / "run")
    reached = next(r for r in evals if r["shifted/accuracy"] >= 0.3)
    assert trainer.summary["target_metric"] == "shifted/accuracy"
    assert trainer.summary["time_to_target_s"] == reached["elapsed_s"]
    # The first set's own name reads its bare record keys, as a bare name does.
    named = train(tmp_path / "named", max_duration="8ep", target_accuracy=0.3, target_metric="val/accuracy")
    bare = next(r for r in eval_records(tmp_path / "named" / "run") if r["accuracy"] >= 0.3)
    assert named.summary["target_metric"] == "accuracy" and named.summary["time_to_target_s"] == bare["elapsed_s"]


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        (["trainer.target_metric=val_2/accuracy"], ["trainer.target_metric='val_2/accuracy'", "val, val_24"]),
        (["trainer.target_metric=f1_macro"], ["trainer.target_metric='f1_macro' is not evaluated"]),
        (
            ["evaluation.metrics=[loss]", "trainer.best_metric=loss"],
            ["trainer.target_metric='accuracy' is not evaluated", "trainer.target_accuracy=null"],
        ),
    ],
)
def test_a_target_metric_not_evaluated_is_one_line_before_anything_is_written(tmp_path, capsys, bad, words):
    run_dir = tmp_path / "run"
    sets = ["data.eval_sets.val={}", "data.eval_sets.val_24.eval_image_size=24", "trainer.target_accuracy=0.5"]
    assert main(["train", *TINY_RUN, *sets, *bad, f"trainer.run_dir={run_dir}"]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert all(word in line for word in words), line
    assert not run_dir.exists()
