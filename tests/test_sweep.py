"""slipstream sweep: an optuna study of normal runs, a table, a best recipe that trains,
resumption from the study's storage, median pruning, and one-line errors for bad syntax.

Each test runs a few 2-epoch trials of a tiny model (~1 s each): a sweep is made of runs."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import optuna
import pytest

from slipstream import ConfigError
from slipstream.cli.main import main
from slipstream.cli.sweep import parse_search_space, run_sweep, trial_rows
from slipstream.config.schema import build_config

TINY = """\
# A tiny recipe: 2 epochs of 4 batches, evaluated after each.
model: {name: test_resnet}
data: {train_size: 64, val_size: 32, image_size: 16, batch_size: 16, num_classes: 4}
optimizer: {name: adamw}
trainer: {threads: 1, max_duration: 2ep, eval_interval: 1ep, checkpoint_interval: null}
"""
LR = "optimizer.lr=loguniform(1e-4,1.0)"


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return path


def sweep(recipe, trials, *space, sweep_dir=None, **kwargs):
    root = sweep_dir or recipe.parent / "sweep"
    return run_sweep(recipe, trials, root, space, verbose=False, **kwargs)


def test_three_trials_a_table_and_a_best_recipe_that_trains(tmp_path, recipe, capsys):
    result = sweep(recipe, 3, LR, "optimizer.weight_decay=choice(0.0,0.05)")
    root = tmp_path / "sweep"
    assert [t.state for t in result.study.trials] == [optuna.trial.TrialState.COMPLETE] * 3
    for n in range(3):
        summary = json.loads((root / f"trial-{n:03d}" / "summary.json").read_text())
        assert summary["status"] == "completed"
        assert summary["accuracy"] == result.study.trials[n].value  # the final evaluation's
    rows = list(csv.DictReader((root / "trials.csv").open()))
    assert [r["trial"] for r in rows] == ["0", "1", "2"]
    assert set(rows[0]) == {"trial", "state", "accuracy", "optimizer.lr", "optimizer.weight_decay", "run_dir"}
    # The seeded TPE sampler draws different values for each trial.
    assert len({r["optimizer.lr"] for r in rows}) == 3

    best = result.study.best_trial
    cfg = build_config(root / "best.yaml")
    assert cfg.optimizer.lr == pytest.approx(best.params["optimizer.lr"])
    assert cfg.optimizer.weight_decay == best.params["optimizer.weight_decay"]
    assert cfg.model.name == "test_resnet" and cfg.trainer.run_dir is None
    capsys.readouterr()
    code = main(["train", "--recipe", str(root / "best.yaml"), "--quiet", f"trainer.run_dir={tmp_path / 'best'}"])
    assert code == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "best" / "summary.json").read_text())["accuracy"] == best.value


def test_a_rerun_continues_the_study_with_the_remaining_trials(tmp_path, recipe):
    sweep(recipe, 2, LR)
    root = tmp_path / "sweep"
    first = (root / "trial-000" / "summary.json").read_text()
    # A trial left running by a killed process is marked failed and not counted.
    storage = f"sqlite:///{root / 'study.db'}"
    optuna.load_study(study_name="slipstream", storage=storage).ask()
    result = sweep(recipe, 3, LR)
    states = [t.state.name for t in result.study.trials]
    assert states == ["COMPLETE", "COMPLETE", "FAIL", "COMPLETE"]
    assert sorted(p.name for p in root.glob("trial-*")) == ["trial-000", "trial-001", "trial-003"]
    assert (root / "trial-000" / "summary.json").read_text() == first  # earlier trials untouched
    # The continued study samples a new point, not the first run's again.
    lrs = [t.params["optimizer.lr"] for t in result.study.trials if t.params]
    assert lrs[-1] not in lrs[:2], lrs
    assert len(list(csv.DictReader((root / "trials.csv").open()))) == 4
    # Nothing left to do: a third run trains nothing.
    assert len(sweep(recipe, 3, LR).study.trials) == 4
    with pytest.raises(ConfigError, match="holds a sweep with other arguments"):
        sweep(recipe, 3, "optimizer.lr=uniform(0.1,0.2)")


def test_a_trial_worse_than_the_median_is_pruned_at_its_first_evaluation(tmp_path, recipe):
    # Two good trials first, then a learning rate that wrecks the model (eval loss ~1e8).
    enqueue = [{"optimizer.lr": 3e-3}, {"optimizer.lr": 3e-3}, {"optimizer.lr": 1.0}]
    result = sweep(recipe, 3, LR, metric="loss", enqueue=enqueue)
    trials = result.study.trials
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE", "PRUNED"]
    assert list(trials[2].intermediate_values) == [64]  # reported after 64 samples (batch 4), stopped there
    summary = json.loads((tmp_path / "sweep" / "trial-002" / "summary.json").read_text())
    assert summary["status"] == "stopped_early" and "pruned" in summary["stop_reason"]
    assert summary["batches"] == 4
    # Without the pruner's start-up trials satisfied, the same trial runs to the end.
    again = sweep(recipe, 1, LR, sweep_dir=tmp_path / "alone", metric="loss", enqueue=enqueue[2:])
    assert again.study.trials[0].state.name == "COMPLETE"


@pytest.mark.parametrize(
    ("argument", "why"),
    [
        ("optimizer.lr=loguniform(1e-3)", "loguniform takes two numbers"),
        ("optimizer.lr=loguniform(0,1)", "loguniform needs 0 < a"),
        ("optimizer.lr=uniform(0.5,0.1)", "uniform needs a < b"),
        ("data.batch_size=int(8,x)", "int takes two integers"),
        ("optimizer.name=choice()", "choice takes one or more"),
        ("optimizer.lr=logunifrom(1e-4,1e-1)", "unknown search form 'logunifrom' (did you mean 'loguniform'?)"),
        ("=uniform(0,1)", "expected a dotted key"),
    ],
)
def test_bad_search_syntax_is_one_line_naming_the_argument_and_the_forms(argument, why):
    with pytest.raises(ConfigError) as info:
        parse_search_space([argument])
    message = str(info.value)
    assert message.startswith(f"sweep argument {argument!r}: {why}")
    assert "key=loguniform(a,b)" in message and "key=choice(x,y,...)" in message
    assert "\n" not in message


def test_the_cli_refuses_bad_syntax_with_exit_2_and_writes_nothing(tmp_path, capsys):
    code = main(["sweep", "--trials", "2", "--sweep-dir", str(tmp_path / "d"), "optimizer.lr=loguniform(1,a)"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.startswith("slipstream: error: sweep argument 'optimizer.lr=loguniform(1,a)'")
    assert not (tmp_path / "d").exists()
    code = main(["sweep", "--trials", "2", "--sweep-dir", str(tmp_path / "d"), "optimizer.lrr=uniform(0,1)"])
    assert code == 2 and "optimizer.lrr" in capsys.readouterr().err and not (tmp_path / "d").exists()


def test_the_engine_imports_optuna_only_for_a_sweep():
    code = (
        "import sys, slipstream, slipstream.cli.main, slipstream.run.build; slipstream.Trainer; "
        "print('optuna' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_cli_runs_a_sweep_with_options_and_forms_in_any_order(tmp_path, recipe, capsys):
    root = tmp_path / "cli"
    code = main(
        ["sweep", "--recipe", str(recipe), "optimizer.lr=loguniform(1e-3,1e-2)", "--trials", "1",
         "--sweep-dir", str(root), "--metric", "loss", "trainer.max_duration=1ep"]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.splitlines()[0].split() == ["trial", "state", "loss", "optimizer.lr", "run_dir"]
    assert f"slipstream train --recipe {root / 'best.yaml'}" in out
    assert json.loads((root / "trial-000" / "summary.json").read_text())["epochs"] == 1  # the fixed override


def test_a_failed_trial_is_replaced_not_counted(tmp_path, recipe):
    # The first trial diverges; --trials 1 still means one finished trial.
    space = ("optimizer.lr=choice(1.0e+30,0.003)", "trainer.max_duration=1ep")
    enqueue = [{"optimizer.lr": 1e30}, {"optimizer.lr": 0.003}]
    result = sweep(recipe, 1, *space, enqueue=enqueue)
    assert [t.state.name for t in result.study.trials] == ["FAIL", "COMPLETE"]
    assert [row["state"] for row in result.rows] == ["fail", "complete"]
    assert result.best_recipe is not None


def test_a_failed_trials_values_are_never_run_again(tmp_path, recipe):
    """Issue 44 ("less often"): a sweep re-sampled a choice value whose trial had failed
    (the docs say it does not). The repeat is not run; an untried value runs instead."""
    space = ("optimizer.lr=choice(1.0e+30,0.003)", "trainer.max_duration=1ep")
    result = sweep(recipe, 1, *space, enqueue=[{"optimizer.lr": 1e30}, {"optimizer.lr": 1e30}])
    assert [row["state"] for row in result.rows] == ["fail", "complete"]
    assert [row["optimizer.lr"] for row in result.rows] == [1e30, 0.003]
    assert not (tmp_path / "sweep" / "trial-001").exists()  # the repeat: sampled, never run


def test_untried_values_of_a_discrete_space():
    import random

    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    from slipstream.cli.sweep import untried

    space = {"a": CategoricalDistribution(["x", "y"]), "b": IntDistribution(1, 2)}
    tried = [{"a": "x", "b": 1}, {"a": "x", "b": 2}, {"a": "y", "b": 1}]
    assert untried(space, tried, random.Random(0)) == {"a": "y", "b": 2}
    assert untried(space, [*tried, {"a": "y", "b": 2}], random.Random(0)) is None
    assert untried({"lr": FloatDistribution(0.1, 1.0)}, [], random.Random(0)) is None


def test_a_sweep_whose_trials_all_fail_exits_1_and_says_so_in_one_line(tmp_path, recipe, capfd):
    root = tmp_path / "failing"
    code = main(["sweep", "--recipe", str(recipe), "--trials", "1", "--sweep-dir", str(root),
                 "optimizer.lr=choice(1.0e+30,2.0e+30)", "trainer.max_duration=1ep"])  # fmt: skip
    err = capfd.readouterr().err
    # Issue 44: no failed value is sampled again; once both have failed, nothing is left.
    assert code == 1 and "every combination of the search space has been tried after 2 failed trials, " \
        "1 trial short" in err
    assert "Traceback" not in err  # optuna's own report of each failure is left out
    assert not (root / "best.yaml").exists()


def test_a_failed_trial_shows_no_metric_to_rank(tmp_path):
    study = optuna.create_study(direction="minimize")
    trial = study.ask()
    trial.report(1e-9, step=4)  # a value better than any, reported before it failed
    study.tell(trial, state=optuna.trial.TrialState.FAIL)
    (row,) = trial_rows(study, "loss", tmp_path)
    assert row["state"] == "fail" and row["loss"] is None


def test_a_trial_that_would_be_pruned_at_its_last_evaluation_has_finished(tmp_path, recipe):
    # One evaluation per trial, the final one: a bad trial is worse than the median
    # there, but it has finished; it completes (and could be the best).
    enqueue = [{"optimizer.lr": 3e-3}, {"optimizer.lr": 3e-3}, {"optimizer.lr": 1.0}]
    result = sweep(recipe, 3, LR, "trainer.max_duration=1ep", metric="loss", enqueue=enqueue)
    assert [t.state.name for t in result.study.trials] == ["COMPLETE", "COMPLETE", "COMPLETE"]
    assert result.study.trials[2].value is not None


def test_the_pruner_compares_trials_after_the_same_number_of_samples():
    """Reported at the samples seen, not the batch: with data.batch_size swept, a trial
    of batch 16 and one of batch 32 meet at the same step after the same data."""
    from types import SimpleNamespace

    from slipstream.cli.sweep import PruningHook
    from slipstream.duration import Duration

    reported = []
    trial = SimpleNamespace(report=lambda value, step: reported.append(step), should_prune=lambda: False)
    hook = PruningHook(trial, "accuracy")
    for batch, size in ((16, 16), (8, 32)):  # one epoch of 256 samples at two batch sizes
        ts = SimpleNamespace(batch=batch, samples=batch * size)
        state = SimpleNamespace(eval_metrics={"accuracy": 0.5}, timestamp=ts, max_duration=Duration.parse("4ep"),
                                time_in=lambda unit: 1.0)
        hook.eval_end(state)
    assert reported == [256, 256]


class Errors:
    """A metric of one's own, lower better: the share of wrong predictions."""

    name = "errors"
    higher_is_better = False

    def __init__(self):
        self.reset()

    def reset(self):
        self.wrong, self.count = 0, 0

    def update(self, logits, targets):
        self.wrong += int((logits.argmax(1) != targets).sum())
        self.count += len(targets)

    def compute(self):
        return self.wrong / max(self.count, 1)


def test_any_evaluated_metric_is_swept_in_its_plugins_direction(tmp_path):
    path = tmp_path / "own.yaml"
    own = "evaluation: {metrics: [loss, 'test_sweep:Errors']}\ntrainer: {best_metric: errors, "
    path.write_text(TINY.replace("trainer: {", own))
    told = r"^--metric 'accuracy' is not evaluated by the trials; they evaluate loss, errors \(evaluation.metrics\)$"
    with pytest.raises(ConfigError, match=told):
        sweep(path, 1, LR)
    assert not (tmp_path / "sweep").exists()
    result = sweep(path, 1, LR, "trainer.max_duration=1ep", "data.train_size=16", metric="errors")
    assert result.study.direction == optuna.study.StudyDirection.MINIMIZE
    assert 0.0 <= result.rows[0]["errors"] <= 1.0
