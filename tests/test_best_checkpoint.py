"""checkpoints/best.pt: the weights of the best evaluation so far, not the last."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from helpers import Probe, ScriptedMetric, train
from slipstream import ConfigError, hookimpl, load_checkpoint


class ScriptedEval(ScriptedMetric):
    """ScriptedMetric that can also poison a weight: after evaluation ``poison_at`` a
    weight becomes NaN."""

    def __init__(self, values, metric="accuracy", poison_at=None):
        super().__init__(values, metric)
        self.poison_at = poison_at

    @hookimpl
    def eval_end(self, state):
        poison = self.seen == self.poison_at
        super().eval_end(state)
        if poison:
            with torch.no_grad():
                next(state.model.parameters()).view(-1)[0] = float("nan")


def weights(payload):
    return {k: v for k, v in payload["model"].items() if v.is_floating_point()}


def same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_best_pt_holds_the_weights_of_the_best_evaluation_not_the_last(tmp_path):
    # 4 batches per epoch, an evaluation and a kept checkpoint at each epoch end.
    trainer = train(
        tmp_path, [ScriptedEval([0.4, 0.9, 0.6])], max_duration="3ep", checkpoint_keep=-1
    )
    paths = trainer.paths
    best = load_checkpoint(paths.best)
    assert best["best"] == {"metric": "accuracy", "value": 0.9, "step": 8, "epoch": 2}
    assert same(weights(best), weights(load_checkpoint(paths.checkpoint(2, 8))))
    assert not same(weights(best), weights(load_checkpoint(paths.latest)))
    assert trainer.summary["best_checkpoint"]["step"] == 8


def test_best_by_loss_keeps_the_lowest(tmp_path):
    trainer = train(
        tmp_path, [ScriptedEval([2.0, 1.5, 1.7], metric="loss")], max_duration="3ep", best_metric="loss"
    )
    assert load_checkpoint(trainer.paths.best)["best"]["value"] == 1.5


def test_no_best_pt_without_a_metric_or_without_checkpoints(tmp_path):
    assert not train(tmp_path / "a", max_duration="1ep", best_metric=None).paths.best.exists()
    assert not train(tmp_path / "b", max_duration="1ep", checkpoint_interval=None).paths.best.exists()
    with pytest.raises(ConfigError, match=r"best_metric='acc' is not evaluated \(did you mean 'accuracy'\?\)"):
        train(tmp_path / "c", best_metric="acc")


def test_best_pt_is_never_written_with_non_finite_weights(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = train(
            tmp_path, [ScriptedEval([0.4, 0.9], poison_at=1)], max_duration="2ep", on_nonfinite="warn"
        )
    assert load_checkpoint(trainer.paths.best)["best"]["value"] == 0.4  # the better one had NaN weights
    assert any("NaN or infinity" in str(w.message) for w in caught)


def test_a_resumed_run_keeps_the_best_of_the_whole_run(tmp_path):
    first = train(tmp_path, [ScriptedEval([0.9, 0.5])], max_duration="2ep")
    best_before = load_checkpoint(first.paths.best)
    train(
        tmp_path, [ScriptedEval([0.7])], max_duration="3ep", load_path=first.paths.latest
    )
    after = load_checkpoint(first.paths.best)
    assert after["best"] == best_before["best"] == {"metric": "accuracy", "value": 0.9, "step": 4, "epoch": 1}


def test_a_resume_that_changes_best_metric_keeps_the_earlier_best(tmp_path):
    """Issue 44 ("less often"): best.pt by accuracy was replaced at the resumed run's
    first evaluation by a best by loss, losing the best weights without a word."""
    first = train(tmp_path, [ScriptedEval([0.9, 0.5])], max_duration="2ep")
    before = load_checkpoint(first.paths.best)
    with pytest.warns(UserWarning, match=r"best.pt was the best by accuracy \(0.9 at step 4\); this run monitors "
                      r"loss, so it is kept as best-accuracy-ba4.pt"):  # fmt: skip
        train(tmp_path, [ScriptedEval([1.5], metric="loss")], max_duration="3ep", best_metric="loss",
              load_path=first.paths.latest)  # fmt: skip
    kept = load_checkpoint(first.paths.best.with_name("best-accuracy-ba4.pt"))
    assert kept["best"] == before["best"] and same(weights(kept), weights(before))
    assert load_checkpoint(first.paths.best)["best"] == {"metric": "loss", "value": 1.5, "step": 12, "epoch": 3}


def test_a_resumed_runs_summary_describes_the_whole_run(tmp_path):
    # Accuracy 0.9 at step 2 only: the best, and past the target, before the checkpoint.
    def script(state):
        state.eval_metrics["accuracy"] = 0.9 if state.timestamp.batch == 2 else 0.1

    options = dict(eval_interval="2ba", checkpoint_interval="2ba", target_accuracy=0.8)
    first = train(tmp_path, [Probe(eval_end=script)], max_duration="10ba", **options)
    assert first.summary["best_accuracy"] == 0.9
    reached = first.summary["time_to_target_s"]
    latest = tmp_path / "run" / "checkpoints" / "latest.pt"
    resumed = train(tmp_path, [Probe(eval_end=script)], max_duration="14ba", load_path=latest, **options)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["batches"] == 14
    assert summary["best_accuracy"] == 0.9 and summary["accuracy"] == 0.1
    assert summary["best_checkpoint"]["step"] == 2
    assert summary["time_to_target_s"] == reached is not None
    assert resumed.summary["best_checkpoint"] == first.summary["best_checkpoint"]


def test_a_resumed_run_keeps_when_its_target_metric_was_reached(tmp_path):
    # A loss of 0.3 at step 4 only: at or below the 0.5 target (downwards), before the checkpoint.
    def script(state):
        state.eval_metrics["loss"] = 0.3 if state.timestamp.batch == 4 else 2.0

    options = dict(eval_interval="2ba", checkpoint_interval="2ba", target_accuracy=0.5, target_metric="loss")
    first = train(tmp_path, [Probe(eval_end=script)], max_duration="6ba", **options)
    reached = first.summary["time_to_target_s"]
    assert reached is not None
    latest = tmp_path / "run" / "checkpoints" / "latest.pt"
    train(tmp_path, [Probe(eval_end=script)], max_duration="8ba", load_path=latest, **options)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["batches"] == 8 and summary["target_metric"] == "loss"
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (record,) = [r for r in evals if r["kind"] == "eval" and r["loss"] == 0.3]
    assert summary["time_to_target_s"] == reached == record["elapsed_s"] and record["step"] == 4
