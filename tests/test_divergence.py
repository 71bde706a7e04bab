"""A non-finite loss stops the run as `diverged`, never reaches a checkpoint, and
every JSON file of the run stays strict JSON."""

import json
import math
import re
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch

from helpers import Probe, train
from slipstream import ConfigError, load_checkpoint
from slipstream.services.divergence import DivergenceMonitor
from slipstream.services.losses import TrainLosses


def strict_loads(text):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def records(run_dir):
    return [strict_loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def poison_from(step):
    """A loss of NaN from `step` on (backward then fills the weights with NaN),
    as a learning rate of 1e12 does, but at a step the test chooses."""

    def after_loss(state):
        if state.timestamp.batch + 1 >= step:
            state.loss = state.loss * float("nan")

    return Probe(after_loss=after_loss)


def finite(payload):
    return all(torch.isfinite(t).all() for t in payload["model"].values() if t.is_floating_point())


def test_nan_loss_stops_at_the_logging_interval_and_keeps_the_last_good_checkpoint(tmp_path):
    trainer = train(
        tmp_path, [poison_from(5)], max_duration="4ep", log_interval=2, checkpoint_interval="1ep"
    )
    summary = trainer.summary
    assert summary["status"] == "diverged"
    assert trainer.state.timestamp.batch == 6  # the interval that saw step 5, not 4 epochs
    assert "step 5" in summary["stop_reason"] and "nan" in summary["stop_reason"]
    assert summary["nonfinite_loss"] == {"first_step": 5, "first_value": "nan", "steps": 2}
    latest = load_checkpoint(trainer.run_dir / "checkpoints" / "latest.pt")
    assert latest["timestamp"]["batch"] == 4 and finite(latest)
    on_disk = strict_loads((trainer.run_dir / "summary.json").read_text())
    assert on_disk["status"] == "diverged"
    logged = records(trainer.run_dir)
    assert [r["step"] for r in logged if r["kind"] == "train"] == [2, 4, 6]
    last = logged[-1]
    assert last["loss"] is None and last["nonfinite"] == ["loss"]


def test_a_checkpoint_is_a_check_point_too(tmp_path):
    # Logging far apart: the check before the checkpoint of step 5 is what stops it.
    trainer = train(
        tmp_path, [poison_from(5)], max_duration="4ep", log_interval=100, checkpoint_interval="1ba"
    )
    assert trainer.summary["status"] == "diverged" and trainer.state.timestamp.batch == 5
    latest = load_checkpoint(trainer.run_dir / "checkpoints" / "latest.pt")
    assert latest["timestamp"]["batch"] == 4 and finite(latest)
    last = records(trainer.run_dir)[-1]  # the interval that diverged is logged all the same
    assert last["step"] == 5 and last["loss"] is None and last["nonfinite"] == ["loss"]


def test_warn_trains_on_but_writes_no_checkpoint_of_nan_weights(tmp_path):
    with pytest.warns(RuntimeWarning) as caught:
        trainer = train(
            tmp_path,
            [poison_from(5)],
            max_duration="3ep",
            log_interval=2,
            checkpoint_interval="1ep",
            on_nonfinite="warn",
        )
    messages = [str(w.message) for w in caught]
    assert any("loss is nan at step 5" in m for m in messages), messages
    assert any("not writing the checkpoint of step 8" in m for m in messages), messages
    # Trained on to the end, but NaN weights never end "completed" (nor are evaluated).
    assert trainer.summary["status"] == "diverged" and trainer.state.timestamp.batch == 12
    assert trainer.summary["nonfinite_loss"]["steps"] == 8  # steps 5 to 12
    latest = load_checkpoint(trainer.run_dir / "checkpoints" / "latest.pt")
    assert latest["timestamp"]["batch"] == 4 and finite(latest)
    summary = strict_loads((trainer.run_dir / "summary.json").read_text())
    assert summary["eval_loss"] is None and summary["accuracy"] is None


def test_finite_run_is_untouched(tmp_path):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="slipstream")
        trainer = train(tmp_path, [], max_duration="1ep", log_interval=2)
    assert trainer.summary["status"] == "completed" and "nonfinite_loss" not in trainer.summary
    assert all("nonfinite" not in r for r in records(trainer.run_dir))


def test_on_nonfinite_is_validated(tmp_path):
    with pytest.raises(ConfigError, match="on_nonfinite must be one of stop, warn, got 'ignore'"):
        train(tmp_path, [], max_duration="1ba", on_nonfinite="ignore")
    assert not (tmp_path / "run").exists()


def test_the_cli_reports_a_learning_rate_of_1e12_as_diverged(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "slipstream", "train", "--quiet", "model.name=test_resnet",
         "data.train_size=64", "data.val_size=32", "data.image_size=16", "data.batch_size=16",
         "trainer.threads=1", "trainer.max_duration=3ep", "trainer.checkpoint_interval=1ba",
         "optimizer.name=sgd", "optimizer.lr=1e12", "trainer.autotune=false", f"trainer.run_dir={run_dir}"],
        capture_output=True, text=True,
    )
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr
    assert re.search(r"diverged: the training loss is (nan|-?inf) at step \d+", result.stderr)
    summary = strict_loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "diverged"
    records(run_dir)  # strict JSON, line by line
    latest = load_checkpoint(run_dir / "checkpoints" / "latest.pt")
    assert finite(latest) and latest["timestamp"]["batch"] < summary["batches"]


@pytest.mark.parametrize(
    "values, diverged",
    [
        ([1.0, 2.0], False),
        ([1e308, 1e308], False),  # finite values whose sum overflows: not a divergence
        ([1.0, float("nan")], True),
        ([float("inf"), float("-inf")], True),  # their sum is nan
        ([float("-inf"), 1.0], True),
    ],
)
def test_the_check_flags_exactly_the_non_finite_values(values, diverged):
    state = SimpleNamespace(world_size=1, summary={}, stop_status=None)
    reported = []
    monitor = DivergenceMonitor(TrainLosses())
    monitor._report = lambda state, values, bad, steps: reported.append(bad)
    monitor.inspect(state, values, [1, 2])
    assert reported == ([[i for i, v in enumerate(values) if not math.isfinite(v)]] if diverged else [])


def test_a_diverged_run_evaluates_nothing_after_it_and_reports_no_accuracy(tmp_path):
    # The losses are read only at the epoch's evaluation (step 4), two steps after
    # the first NaN: the evaluation is not run on the NaN weights, the run stops there.
    trainer = train(
        tmp_path, [poison_from(2)], max_duration="3ep", log_interval=100,
        checkpoint_interval=None, eval_interval="1ep",
    )
    summary = strict_loads((trainer.run_dir / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["batches"] == 4
    assert summary["accuracy"] is None and summary["eval_loss"] is None and summary.get("best_accuracy") is None
    assert "at step 2" in summary["stop_reason"] and "stopped at step 4" in summary["stop_reason"]
    assert [r for r in records(trainer.run_dir) if r["kind"] == "eval"] == []


def test_final_weights_that_are_not_finite_never_end_completed(tmp_path):
    # warn trains on; the evaluations of NaN weights are skipped, and the end says diverged.
    with pytest.warns(RuntimeWarning, match="weights are not finite at step 8"):
        trainer = train(
            tmp_path, [poison_from(5)], max_duration="3ep", log_interval=2,
            checkpoint_interval=None, on_nonfinite="warn",
        )
    summary = strict_loads((trainer.run_dir / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["batches"] == 12
    assert summary["accuracy"] is None and summary["nonfinite_weights"] == {"first_step": 8}
    assert [r["step"] for r in records(trainer.run_dir) if r["kind"] == "eval"] == [4]


def test_compare_and_plot_show_a_diverged_run_by_its_status(tmp_path):
    from slipstream.run.results import build_figure, compare_runs, compare_runs_json, load_run

    good = train(tmp_path / "good", [], max_duration="1ep", checkpoint_interval=None)
    bad = train(tmp_path / "bad", [poison_from(2)], max_duration="2ep", log_interval=100, checkpoint_interval=None)
    runs = [load_run(good.run_dir), load_run(bad.run_dir)]
    base, row = compare_runs_json(runs, target=0.01)
    assert base["final_accuracy_pct"] is not None and base["speedup"] == 1.0
    assert row["status"] == "diverged"
    assert row["final_accuracy_pct"] is None and row["best_accuracy_pct"] is None
    assert row["speedup"] is None and row["time_to_target_s"] is None
    assert compare_runs(runs).splitlines()[-1].rstrip().endswith("diverged")
    figure = build_figure(runs)
    assert "run (diverged)" in [t.get_text() for t in figure.legends[0].get_texts()]
    assert any("run: diverged" in t.get_text() for ax in figure.axes for t in ax.texts)
