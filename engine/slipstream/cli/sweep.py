"""``slipstream sweep``: hyper-parameter search over a recipe with optuna.

One optuna study per sweep directory, stored in ``D/study.db`` (SQLite), so that a
sweep interrupted at any point continues when it is run again with the same
directory. Trials are ordinary runs in ``D/trial-000``, ``D/trial-001``, ... sampled
by a seeded TPE sampler; each evaluation reports the metric to a median pruner
through a small plugin registered on the trial's Trainer, which stops the run
cleanly when the pruner says so (as optuna's own Lightning callback does); the
trial is then told to optuna as pruned. At the end: a table of the trials (printed
and ``D/trials.csv``) and ``D/best.yaml``, a complete recipe with the best values.
``--metric`` is any metric the trials evaluate, its direction its plugin's
``higher_is_better`` unless ``--direction`` says.

Only this module imports optuna, and only ``slipstream sweep`` imports this module.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import random
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import TrialState

from slipstream.config.schema import build_config, build_run, data_task, known_num_classes, to_dict
from slipstream.data.sources import eval_set_configs
from slipstream.errors import ConfigError, did_you_mean
from slipstream.hookspecs import hookimpl
from slipstream.optim import OPTIMIZERS
from slipstream.plugins.discovery import CALLBACKS_GROUP, discover, instantiate
from slipstream.plugins.metric import parse_metrics, record_key, split_set, task_best_metric
from slipstream.run.build import build_trainer
from slipstream.run.directory import atomic_write_text
from slipstream.state import State

STUDY_DB = "study.db"
TRIALS_CSV = "trials.csv"
BEST_RECIPE = "best.yaml"
DIRECTIONS = ("maximize", "minimize")
FORMS = (
    "key=loguniform(a,b) with 0 < a < b, key=uniform(a,b) with a < b, "
    "key=int(a,b) with integers a < b, key=choice(x,y,...), or key=value"
)
_CALL = re.compile(r"^([A-Za-z_]\w*)\((.*)\)$", re.DOTALL)


@dataclass(frozen=True)
class SearchSpace:
    """The parsed ``key=FORM(...)`` arguments, and the ``key=value`` ones kept as
    overrides for every trial."""

    distributions: dict[str, BaseDistribution] = field(default_factory=dict)
    fixed: tuple[str, ...] = ()

    def overrides(self, params: dict[str, Any]) -> list[str]:
        # JSON is valid YAML: strings stay strings, 1e-05 stays a float.
        return [*self.fixed, *(f"{key}={json.dumps(value)}" for key, value in params.items())]

    def describe(self) -> dict[str, Any]:
        return {
            "space": {k: optuna.distributions.distribution_to_json(d) for k, d in self.distributions.items()},
            "fixed": list(self.fixed),
        }


def _bad(item: str, why: str) -> ConfigError:
    return ConfigError(f"sweep argument {item!r}: {why}; allowed forms: {FORMS}")


def _numbers(item: str, form: str, args: list[str], kind: type) -> tuple[Any, Any]:
    try:
        values = [kind(a) for a in args]
    except ValueError:
        values = []
    what = "integers" if kind is int else "numbers"
    if len(values) != 2:
        raise _bad(item, f"{form} takes two {what}, {form}(a,b)")
    low, high = values
    if not low < high:
        raise _bad(item, f"{form} needs a < b, got a={low}, b={high}")
    if form == "loguniform" and low <= 0:
        raise _bad(item, f"loguniform needs 0 < a, got a={low}")
    return low, high


def parse_search_space(arguments: Sequence[str]) -> SearchSpace:
    """``["optimizer.lr=loguniform(1e-4,1e-1)", "data.batch_size=64"]`` -> a space
    of one float distribution and one fixed override. Bad syntax is a ConfigError
    that names the argument and the allowed forms."""
    distributions: dict[str, BaseDistribution] = {}
    fixed: list[str] = []
    for item in arguments:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not re.fullmatch(r"[\w.-]+", key):
            raise _bad(item, "expected a dotted key, '=' and a value or search form")
        call = _CALL.match(value)
        if call is None:
            fixed.append(f"{key}={value}")
            continue
        form, args = call.group(1), [a.strip() for a in call.group(2).split(",")]
        if form in ("loguniform", "uniform"):
            low, high = _numbers(item, form, args, float)
            distributions[key] = FloatDistribution(low, high, log=form == "loguniform")
        elif form == "int":
            low, high = _numbers(item, form, args, int)
            distributions[key] = IntDistribution(low, high)
        elif form == "choice":
            if not all(args):
                raise _bad(item, "choice takes one or more comma-separated values, choice(x,y)")
            choices = [yaml.safe_load(a) for a in args]
            if not all(isinstance(c, (str, int, float, bool)) for c in choices):
                raise _bad(item, "choice values must be numbers, strings or booleans")
            distributions[key] = CategoricalDistribution(choices)
        else:
            hint = did_you_mean(form, ("loguniform", "uniform", "int", "choice"))
            raise _bad(item, f"unknown search form {form!r}{hint}")
        if key in distributions and any(f.startswith(f"{key}=") for f in fixed):
            raise _bad(item, f"{key} is both fixed and searched")
    return SearchSpace(distributions, tuple(fixed))


MAX_FAILURES = 3


class PruningHook:
    """Reports the metric at every evaluation; stops the run when the pruner says so.

    Registered on each trial's Trainer. The run ends after the current batch with
    status ``stopped_early`` (its checkpoint and summary are written as for any
    stop); the sweep then raises ``optuna.TrialPruned`` for the trial.
    """

    name = "sweep.pruner"

    def __init__(self, trial: optuna.Trial, metric: str) -> None:
        self.trial = trial
        self.metric = metric
        self.last: float | None = None
        self.pruned_at: int | None = None

    @hookimpl
    def eval_end(self, state: State) -> None:
        value = state.eval_metrics.get(self.metric)
        if value is None or not math.isfinite(value):
            return
        self.last = float(value)
        step = state.timestamp.batch
        # Keyed by samples seen, not batches: the pruner compares trials at one step,
        # and a sweep over data.batch_size would otherwise compare a trial's second
        # epoch with another's fourth.
        self.trial.report(self.last, step=state.timestamp.samples)
        # At the run's last evaluation the trial has finished: it completes, with
        # its value, and can be the best; pruning it would save nothing.
        finished = state.time_in(state.max_duration.unit) >= state.max_duration.value
        if self.pruned_at is None and not finished and self.trial.should_prune():
            self.pruned_at = step
            state.request_stop(
                "stopped_early",
                f"pruned by the sweep's median pruner at batch {step} ({self.metric} {self.last:.4f})",
            )


class _TrialFailed(Exception):
    """A trial whose run diverged or failed: optuna records it as failed; the sweep goes on."""


class _Repeat(Exception):
    """A trial sampled with the values of a trial that failed: never run, told to optuna
    as failed (it has no way to take a trial back) and marked :data:`REPEAT`."""


# The user attribute of a trial that repeated a failed one's values: left out of the table.
REPEAT = "slipstream_repeat_of_failed"
# A discrete space of more combinations than this is searched for an untried one at random.
ENUMERATE_AT_MOST = 100_000


@dataclass
class SweepResult:
    study: optuna.Study
    rows: list[dict[str, Any]]
    best_recipe: Path | None
    short: int = 0  # trials asked for that no trial finished (each failed)


def run_sweep(
    recipe: str | Path,
    trials: int,
    sweep_dir: str | Path,
    arguments: Sequence[str] = (),
    *,
    metric: str = "accuracy",
    direction: str | None = None,
    pruner_startup_trials: int = 2,
    enqueue: Sequence[dict[str, Any]] = (),
    verbose: bool = True,
) -> SweepResult:
    """Run (or continue) the sweep in ``sweep_dir`` until it holds ``trials``
    finished (completed or pruned) trials. ``enqueue`` lists parameter sets to try
    first (optuna's ``enqueue_trial``), for a sweep that must start from known values."""
    where, bare = split_set(metric)  # SET/METRIC: a metric of another evaluation set (data.eval_sets)
    if direction is not None and direction not in DIRECTIONS:
        raise ConfigError(f"--direction {direction!r}: use maximize or minimize")
    if trials < 1:
        raise ConfigError(f"--trials must be at least 1, got {trials}")
    if pruner_startup_trials < 0:
        raise ConfigError(
            f"--pruner-startup-trials must be 0 or more (finished trials before pruning), got {pruner_startup_trials}"
        )
    space = parse_search_space(arguments)
    if not space.distributions:
        raise ConfigError(f"sweep: nothing to search; give at least one argument of the form {FORMS}")
    # The whole space is checked against the config before anything is written:
    # each form's lower end, as a trial would set it.
    lows = {k: _low(d) for k, d in space.distributions.items()}
    base = _check_trial_config(recipe, space.overrides(lows))
    # Every other value of a choice too: a trial must not be the first to find one bad.
    for key, dist in space.distributions.items():
        if isinstance(dist, CategoricalDistribution):
            for value in dist.choices[1:]:
                _check_trial_config(recipe, space.overrides({**lows, key: value}))
    if base.trainer.eval_interval is None:
        raise ConfigError("sweep: trials need evaluations to compare; set trainer.eval_interval (e.g. 1ep)")
    sets = list(eval_set_configs(base.data))
    if where is not None and where not in sets:
        raise ConfigError(f"--metric {metric}: the trials evaluate no set {where!r}; their sets: {', '.join(sets)}")
    task = data_task(base)
    metric = task_best_metric(metric, task) or metric  # the default accuracy: map of multi-hot targets
    direction = direction or _direction(metric, base, task)
    metric = record_key(metric, sets) or metric  # the eval records' key: the first set's are bare
    classes = known_num_classes(base)
    if metric == "accuracy_top5" and classes is not None and classes < 5:
        raise ConfigError(
            f"--metric accuracy_top5 needs at least 5 classes; these runs have {classes}: "
            "use accuracy or loss"
        )

    root = Path(sweep_dir)
    root.mkdir(parents=True, exist_ok=True)
    # A failed trial is told in one line below; optuna's own warning adds its traceback.
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(
        study_name="slipstream",
        storage=f"sqlite:///{(root / STUDY_DB).resolve()}",
        pruner=optuna.pruners.MedianPruner(n_startup_trials=pruner_startup_trials),
        direction=direction,
        load_if_exists=True,
    )
    described = {"recipe": str(recipe), "metric": metric, "direction": direction, **space.describe()}
    _check_same_sweep(study, described, root)
    for stale in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study.tell(stale.number, state=TrialState.FAIL)  # its process was killed mid-trial
    # Seeded from the trainer's seed and the trials the study holds: the same command
    # gives the same sweep, and a continued one samples new points instead of
    # repeating the first ones (the sampler keeps no state in the storage).
    study.sampler = optuna.samplers.TPESampler(seed=int(base.trainer.seed) + len(study.trials))
    done = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))
    if not study.trials:
        for params in enqueue:
            study.enqueue_trial(params)
    remaining = max(trials - done, 0)
    if verbose and done:
        print(f"slipstream: sweep {root}: {_count(done, 'trial')} done, {remaining} to go", file=sys.stderr)

    remaining = _run_trials(
        study,
        space,
        lambda trial, params: _run_trial(recipe, space.overrides(params), root, trial, metric, verbose),
        trials=trials,
        done=done,
        remaining=remaining,
        seed=int(base.trainer.seed),
        root=root,
        verbose=verbose,
    )
    rows = trial_rows(study, metric, root)
    write_trials_csv(rows, root / TRIALS_CSV)
    best = _write_best_recipe(study, recipe, space, root, metric)
    if verbose:
        print(format_trials(rows))
        if best is not None:
            print(f"best recipe: {best}  (slipstream train --recipe {best})")
    return SweepResult(study, rows, best, short=remaining)


def _run_trials(
    study: optuna.Study,
    space: SearchSpace,
    run: Any,
    *,
    trials: int,
    done: int,
    remaining: int,
    seed: int,
    root: Path,
    verbose: bool,
) -> int:
    """Run trials until ``remaining`` more have finished (``run(trial, params)`` runs
    one); returns how many are still short after too many failures."""
    rng = random.Random(seed + len(study.trials))
    exhausted = False

    def objective(trial: optuna.Trial) -> float:
        nonlocal exhausted
        params = {key: suggest(trial, key, dist) for key, dist in space.distributions.items()}
        # TPE may sample a failed trial's values again (only ever equal in a discrete
        # space): that trial is not run; untried values are queued in its place.
        if any(params == t.params for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))):
            trial.set_user_attr(REPEAT, True)
            fresh = untried(space.distributions, [t.params for t in study.trials], rng)
            if fresh is None:
                exhausted = True
            else:
                study.enqueue_trial(fresh)
            raise _Repeat
        return run(trial, params)

    # A failed trial does not count toward --trials: another one is run in its place,
    # up to as many failures in this call as trials were asked for (at least 3): a
    # space where every trial fails must not run for ever.
    failures = 0
    while remaining and failures < max(trials, MAX_FAILURES) and not exhausted:
        study.optimize(objective, n_trials=1, catch=(_TrialFailed, _Repeat))
        finished = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))
        if finished > done:
            done, remaining = finished, remaining - 1
        elif not study.trials[-1].user_attrs.get(REPEAT):
            failures += 1
    if remaining and verbose:
        why = "every combination of the search space has been tried" if exhausted else "stopped"
        print(
            f"slipstream: sweep {root}: {why} after {_count(failures, 'failed trial')}, "
            f"{_count(remaining, 'trial')} short; see the failed trials' run directories",
            file=sys.stderr,
        )
    return remaining


def _direction(metric: str, base: Any, task: str) -> str:
    """The study's direction for ``metric``: its metric plugin's (``higher_is_better``),
    or a one-line ConfigError naming the metrics the trials evaluate."""
    items = base.evaluation.metrics
    specs = parse_metrics(to_dict(items) if items is not None else None, task)
    bare = split_set(metric)[1]
    names = [s.name for s in specs if not s.to_file]
    for spec in specs:
        if not spec.to_file and (bare == spec.name or bare.startswith(f"{spec.name}_")):
            return "maximize" if spec.higher_is_better else "minimize"
    raise ConfigError(
        f"--metric {metric!r} is not evaluated by the trials{did_you_mean(bare, names)}; they evaluate "
        f"{', '.join(names)} (evaluation.metrics)"
    )


def _check_trial_config(recipe: str | Path, overrides: list[str]) -> Any:
    """The config of a trial with ``overrides``, checked as far as it can be without
    building data and model: the config itself, the plugins' options, the optimizer."""
    cfg = build_config(recipe, None, overrides)
    installed = discover(load=False)
    instantiate(dict(to_dict(cfg.algorithms)), installed)
    instantiate(dict(to_dict(cfg.callbacks)), discover(load=False, group=CALLBACKS_GROUP), CALLBACKS_GROUP)
    if cfg.optimizer.name not in OPTIMIZERS:
        raise ConfigError(
            f"optimizer.name {cfg.optimizer.name!r} is not supported; choose one of {', '.join(OPTIMIZERS)}"
        )
    return cfg


def untried(
    distributions: dict[str, BaseDistribution], tried: Sequence[dict[str, Any]], rng: random.Random
) -> dict[str, Any] | None:
    """Values for every key of a discrete space (choices and integers) that no trial
    has had, drawn with ``rng``; None when every combination has been tried or the space
    is not discrete (a continuous value is never drawn twice)."""
    values: dict[str, list[Any]] = {}
    for key, dist in distributions.items():
        if isinstance(dist, CategoricalDistribution):
            values[key] = list(dist.choices)
        elif isinstance(dist, IntDistribution):
            values[key] = list(range(dist.low, dist.high + 1, dist.step))
        else:
            return None
    keys = list(values)
    seen = {tuple(t.get(k) for k in keys) for t in tried}
    if math.prod(len(v) for v in values.values()) <= ENUMERATE_AT_MOST:
        fresh = [c for c in itertools.product(*values.values()) if c not in seen]
        return dict(zip(keys, rng.choice(fresh), strict=True)) if fresh else None
    for _ in range(1000):  # a space this large is mostly untried
        combination = tuple(rng.choice(v) for v in values.values())
        if combination not in seen:
            return dict(zip(keys, combination, strict=True))
    return None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def suggest(trial: optuna.Trial, key: str, dist: BaseDistribution) -> Any:
    """The trial's value for ``key``, through optuna's public suggest API."""
    if isinstance(dist, FloatDistribution):
        return trial.suggest_float(key, dist.low, dist.high, log=dist.log)
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(key, dist.low, dist.high)
    return trial.suggest_categorical(key, dist.choices)


def _low(dist: BaseDistribution) -> Any:
    return dist.choices[0] if isinstance(dist, CategoricalDistribution) else dist.low


def _check_same_sweep(study: optuna.Study, described: dict[str, Any], root: Path) -> None:
    saved = study.user_attrs.get("sweep")
    if saved is None:
        study.set_user_attr("sweep", described)
    elif saved != described:
        raise ConfigError(
            f"sweep directory {root} holds a sweep with other arguments ({saved['recipe']}, "
            f"{saved['metric']} {saved['direction']}, {sorted(saved['space'])}); continue it with "
            "the same arguments, or choose another --sweep-dir"
        )


def _run_trial(
    recipe: str | Path,
    overrides: list[str],
    root: Path,
    trial: optuna.Trial,
    metric: str,
    verbose: bool,
) -> float:
    run_dir = root / f"trial-{trial.number:03d}"
    run = [f"trainer.run_dir={json.dumps(str(run_dir))}", "trainer.progress_bar=false"]
    spec = build_run(recipe, None, [*overrides, *run])
    trainer = build_trainer(spec, label=run_dir.name, verbose=False)
    hook = PruningHook(trial, metric)
    trainer.pm.register(hook, name=PruningHook.name)
    summary = trainer.fit()
    status = summary.get("status")
    params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in trial.params.items())
    if status == "interrupted":
        raise KeyboardInterrupt(f"sweep interrupted in trial {trial.number} ({run_dir})")
    if hook.pruned_at is not None:
        if verbose:
            print(f"trial {trial.number}: {params} -> pruned at batch {hook.pruned_at}", file=sys.stderr)
        raise optuna.TrialPruned(summary.get("stop_reason"))
    if status in ("diverged", "failed") or hook.last is None:
        if verbose:
            print(f"trial {trial.number}: {params} -> {status}", file=sys.stderr)
        raise _TrialFailed(f"trial {trial.number} ended {status} ({run_dir})")
    if verbose:
        print(f"trial {trial.number}: {params} -> {metric} {hook.last:.4f}", file=sys.stderr)
    return hook.last


def trial_rows(study: optuna.Study, metric: str, root: Path) -> list[dict[str, Any]]:
    """One row per trial: number, state, the metric, each parameter, the run directory."""
    keys = sorted({k for t in study.trials for k in t.params})
    rows = []
    for t in study.trials:
        if t.user_attrs.get(REPEAT):  # sampled again after a failure, never run
            continue
        # A pruned trial shows the last value it reported; a failed one none, whatever
        # it reported before it diverged (it is no result to rank).
        value = t.value if t.state == TrialState.COMPLETE else None
        if t.state == TrialState.PRUNED:
            value = t.intermediate_values.get(t.last_step or -1)
        rows.append(
            {
                "trial": t.number,
                "state": t.state.name.lower(),
                metric: value,
                **{k: t.params.get(k) for k in keys},
                "run_dir": str(root / f"trial-{t.number:03d}"),
            }
        )
    return rows


def write_trials_csv(rows: list[dict[str, Any]], path: Path) -> None:
    if not rows:
        return
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def format_trials(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no trials"

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return "-" if value is None else str(value)

    columns = list(rows[0])
    table = [columns, *([cell(r[c]) for c in columns] for r in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip() for line in table)


def _write_best_recipe(
    study: optuna.Study, recipe: str | Path, space: SearchSpace, root: Path, metric: str
) -> Path | None:
    completed = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not completed:
        return None
    best = study.best_trial
    cfg = to_dict(build_config(recipe, None, space.overrides(best.params)))
    # A recipe for a new run: not the trial's directory, nor its checkpoint.
    cfg["trainer"].update(run_dir=None, load_path=None, overwrite=False)
    values = ", ".join(f"{k}={v}" for k, v in best.params.items())
    header = (
        f"# Best of {len(trial_rows(study, metric, root))} trials of `slipstream sweep` over {recipe} "
        f"(trial {best.number}: {metric} {best.value:.4f}).\n# Searched values: {values}\n"
    )
    path = root / BEST_RECIPE
    atomic_write_text(path, header + yaml.safe_dump(cfg, sort_keys=False))
    return path
