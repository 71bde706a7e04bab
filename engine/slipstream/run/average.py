"""Checkpoint averaging: ``slipstream average RUN_DIR --last N | --best N -o FILE``.

The weights of several checkpoints of one run are averaged into one checkpoint (as
timm's ``avg_checkpoints.py``): the ``N`` most recent (``--last``), or the ``N`` best by
the run's ``trainer.best_metric`` (``--best``), any evaluated metric, in the direction
its checkpoints record (``"ranked_by"``) or its metric plugin's ``higher_is_better``.
Floating-point tensors are summed in float64 and the mean cast back to their dtype;
integer buffers (BatchNorm's ``num_batches_tracked``) are the most recent checkpoint's. Every set of weights the
checkpoints hold is averaged: the model's and each one a plugin keeps (``ema``), so the
file is evaluated and exported with ``--ema`` as its sources are.

A checkpoint knows its metric from the evaluation of its step: the ``"eval"`` record the
checkpointer writes into it when that evaluation came first, else ``best.pt``'s
``"best"``, else the eval record of ``metrics.jsonl`` at its step (the run's final
evaluation comes after its last checkpoint).

The file written is the most recent source's checkpoint with the averaged weights,
without optimizer state, schedules or generators (no run continues from it), and with
``"averaged"``: the mode, the metric, the weights averaged and the sources (file, step,
epoch, metric value).
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from slipstream.config.options import BEST_METRICS
from slipstream.errors import CheckpointError, ConfigError
from slipstream.run.checkpoint import load_checkpoint, save_checkpoint, select_weights, weight_problems, weights_in
from slipstream.run.directory import BEST, LATEST, RunDir

MODES = ("last", "best")
# A checkpoint file of the run-directory contract: -o never names one.
_RUN_CHECKPOINT = re.compile(r"ep\d+-ba\d+\.pt")
# What a run needs to continue, and an averaged file has no use for.
_TRAINING_ONLY = ("optimizer_class", "rng", "train_losses", "best", "eval", "ranked_by")


@dataclass(frozen=True)
class Source:
    """One checkpoint averaged: its file, step, epoch and metric value (None: not
    evaluated at its step)."""

    path: Path
    step: int
    epoch: int | None
    value: float | None


def average_state_dicts(state_dicts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The mean of ``state_dicts`` (oldest first): each floating-point (or complex)
    tensor summed in float64 (complex128) and the mean cast back to its dtype; every
    other entry (integer buffers such as ``num_batches_tracked``) the last one's.
    They must hold the same names, shapes and dtypes (a ValueError names the first
    that differs). One tensor's sum is held at a time."""
    if not state_dicts:
        raise ValueError("no state dicts to average")
    last = state_dicts[-1]
    for i, other in enumerate(state_dicts[:-1]):
        if list(other) != list(last):
            differ = sorted(set(other) ^ set(last)) or ["(the same names in another order)"]
            raise ValueError(f"state dict {i} and the last hold different names: {', '.join(differ[:5])}")
    out: dict[str, Any] = {}
    for name, latest in last.items():
        if not isinstance(latest, torch.Tensor) or not (latest.is_floating_point() or latest.is_complex()):
            out[name] = latest.clone() if isinstance(latest, torch.Tensor) else latest
            continue
        wide = torch.complex128 if latest.is_complex() else torch.float64
        total = torch.zeros(latest.shape, dtype=wide)
        for i, state_dict in enumerate(state_dicts):
            tensor = state_dict[name]
            if tensor.shape != latest.shape or tensor.dtype != latest.dtype:
                raise ValueError(
                    f"{name}: state dict {i} has {tuple(tensor.shape)} {tensor.dtype}, "
                    f"the last {tuple(latest.shape)} {latest.dtype}"
                )
            total += tensor.to(device="cpu", dtype=wide)
        out[name] = total.div_(len(state_dicts)).to(latest.dtype)
    return out


def evaluated_values(run: RunDir, metric: str) -> dict[int, float]:
    """``metric``'s finite value at each step ``run``'s metrics.jsonl has an eval
    record of (a line a crash cut short is skipped)."""
    values: dict[int, float] = {}
    try:
        lines = run.metrics.read_text(encoding="utf-8").splitlines()
    except OSError:
        return values
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or record.get("kind") != "eval":
            continue
        value, step = record.get(metric), record.get("step")
        if isinstance(value, (int, float)) and math.isfinite(value) and isinstance(step, int):
            values[step] = float(value)
    return values


def check_output(output: str | Path, run_dir: str | Path, overwrite: bool = False) -> Path:
    """Refuse, in one line and before anything is read, an ``output`` that is a
    directory, one of the run's checkpoints (or a name the run writes checkpoints
    under), or an existing file without ``overwrite``."""
    output, checkpoints = Path(output), RunDir(Path(run_dir)).checkpoints
    if output.is_dir():
        raise ConfigError(f"-o {output} is a directory; give the file to write, e.g. {output}/averaged.pt")
    named = output.name in (LATEST, BEST) or _RUN_CHECKPOINT.fullmatch(output.name)
    if named and checkpoints.is_dir() and output.resolve().parent == checkpoints.resolve():
        raise ConfigError(
            f"-o {output} is a checkpoint of the run in {run_dir} (a name the run writes); "
            "give a file outside its checkpoints folder, e.g. averaged.pt"
        )
    if output.exists() and not overwrite:
        raise ConfigError(f"-o {output} exists; give --overwrite to replace it, or another file")
    return output


def _checkpoints(run: RunDir) -> list[tuple[Source, dict[str, Any]]]:
    """Each checkpoint of ``run`` at a step of its own (interval ones, then latest.pt and
    best.pt where no interval one has their step), oldest first, read with its tensors
    left in the file. Interval checkpoints past latest.pt's step (left by a resume from
    an earlier checkpoint, their steps discarded) are left out, with a warning."""
    files = [path for _, path in run.interval_checkpoints()]
    files += [p for p in (run.latest, run.best) if p.is_file()]
    found: dict[int, tuple[Path, dict[str, Any]]] = {}
    last: int | None = None
    for path in files:
        payload = load_checkpoint(path, mmap=True)
        step = int((payload.get("timestamp") or {}).get("batch", -1))
        found.setdefault(step, (path, payload))
        last = step if path == run.latest else last
    if last is not None:
        past = sorted(step for step in found if step > last)
        if past:
            names = ", ".join(found[step][0].name for step in past)
            warnings.warn(
                f"slipstream: left out {names}: past latest.pt's step {last} (a resume from an earlier "
                "checkpoint discarded those steps)",
                stacklevel=3,
            )
            found = {step: item for step, item in found.items() if step <= last}
    return [
        (Source(path, step, (payload.get("timestamp") or {}).get("epoch"), None), payload)
        for step, (path, payload) in sorted(found.items())
    ]


def _recent(found: list[tuple[Source, dict[str, Any]]], keep: Any) -> list[tuple[Source, dict[str, Any]]]:
    """The checkpoints of ``found`` that follow one another to the newest: those from the
    oldest of the last ``keep`` (trainer.checkpoint_keep) interval checkpoints on. Older
    ones are there for their metric (trainer.keep_best), with gaps between them."""
    if not isinstance(keep, int) or keep < 0:
        return found
    interval = [s for s, _ in found if _RUN_CHECKPOINT.fullmatch(s.path.name)]
    if keep > len(interval):  # none deleted for being old
        return found
    start = interval[-keep].step if keep else found[-1][0].step  # keep 0: latest.pt alone
    return [(s, p) for s, p in found if s.step >= start]


def ranking(payload: Mapping[str, Any]) -> tuple[str | None, bool | None]:
    """The metric that ranks a run's checkpoints (its eval records' key) and whether
    higher is better (None: not known): what the checkpoint records under
    ``"ranked_by"``, else (a checkpoint written before it did) the run's
    ``trainer.best_metric`` and the direction its metric plugin declares."""
    ranked = payload.get("ranked_by")
    if isinstance(ranked, Mapping) and isinstance(ranked.get("metric"), str):
        if isinstance(ranked.get("higher_is_better"), bool):
            return ranked["metric"], ranked["higher_is_better"]
    config = payload.get("config") or {}
    metric = (config.get("trainer") or {}).get("best_metric")
    if not isinstance(metric, str):
        return None, None
    if metric in BEST_METRICS:
        return metric, BEST_METRICS[metric]
    from slipstream.plugins.metric import parse_metrics  # imports the metric plugins: only here

    try:
        specs = parse_metrics((config.get("evaluation") or {}).get("metrics"))
    except ConfigError:  # a plugin no longer installed
        return metric, None
    named = [s for s in specs if metric == s.name or metric.startswith(f"{s.name}_")]
    return metric, (named[0].higher_is_better if named else None)


def _value(payload: Mapping[str, Any], step: int, metric: str, logged: Mapping[int, float]) -> float | None:
    """``metric`` at the checkpoint's step: its own eval record, best.pt's, the log's."""
    evaluated = payload.get("eval")
    if isinstance(evaluated, Mapping) and evaluated.get("step") == step:
        value = evaluated.get(metric)
        if isinstance(value, (int, float)) and math.isfinite(value):
            return float(value)
    best = payload.get("best")
    if isinstance(best, Mapping) and best.get("metric") == metric and best.get("step") == step:
        return float(best["value"])
    return logged.get(step)


def _too_few(run_dir: Path, mode: str, count: int, chosen: list[Source], payload: Mapping[str, Any]) -> str:
    """The one line for a run that holds fewer than ``count`` checkpoints to average,
    naming the option that keeps more."""
    trainer = (payload.get("config") or {}).get("trainer") or {}
    steps = ", ".join(str(s.step) for s in chosen) or "none"
    keep, keep_best = trainer.get("checkpoint_keep", 2), trainer.get("keep_best", 0)
    interval = trainer.get("checkpoint_interval")
    if mode == "last":
        held = f"--last {count}: the run in {run_dir} holds {len(chosen)} checkpoint(s) (steps {steps})"
        if keep == -1 or keep >= count:
            return f"{held}, every one it wrote: write them more often (trainer.checkpoint_interval, it was {interval})"
        return (
            f"{held}: trainer.checkpoint_keep={keep} keeps only the last {keep}; train with "
            f"trainer.checkpoint_keep={count} or more (-1 keeps all)"
        )
    held = (
        f"--best {count}: the run in {run_dir} holds {len(chosen)} checkpoint(s) evaluated at their step "
        f"(steps {steps}; ranked by {trainer.get('best_metric')})"
    )
    if keep == -1 or keep_best >= count:
        return (
            f"{held}: evaluate at the checkpoints' steps (trainer.eval_interval, it was "
            f"{trainer.get('eval_interval')}, as trainer.checkpoint_interval, {interval})"
        )
    return (
        f"{held}: trainer.keep_best={keep_best}; train with trainer.keep_best={count} to keep the "
        f"{count} best besides the last checkpoint_keep"
    )


def choose_sources(run_dir: str | Path, mode: str, count: int) -> tuple[list[Source], list[dict[str, Any]], str | None]:
    """The checkpoints of ``run_dir`` to average (oldest first), their payloads (tensors
    left in the files) and the run's ``best_metric`` (which ranks them with ``best``;
    None where the run has none), or a one-line
    CheckpointError: no checkpoints, or fewer than ``count``."""
    if mode not in MODES:
        raise ConfigError(f"average: mode {mode!r} is not one of {', '.join(MODES)}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"--{mode} must be a whole number of checkpoints, at least 1; got {count!r}")
    run_dir = Path(run_dir)
    run = RunDir(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"run directory {run_dir} does not exist")
    found = _checkpoints(run)
    if not found:
        raise CheckpointError(f"no checkpoints in {run.checkpoints}: give the directory of a run that wrote some")
    newest = found[-1][1]
    metric, higher = ranking(newest)
    if mode == "best" and higher is None:
        why = (
            "no metric ranks its checkpoints"
            if metric is None
            else "neither its checkpoints nor an installed metric plugin say whether higher is better"
        )
        raise ConfigError(
            f"--best: the run in {run_dir} has trainer.best_metric={metric}: {why}; average the most "
            "recent checkpoints with --last"
        )
    if metric is not None and higher is not None:  # each source's value, recorded with --last too
        logged = evaluated_values(run, metric)
        found = [(Source(s.path, s.step, s.epoch, _value(p, s.step, metric, logged)), p) for s, p in found]
    else:
        metric = None
    if mode == "last":
        keep = ((newest.get("config") or {}).get("trainer") or {}).get("checkpoint_keep", -1)
        recent = _recent(found, keep)
        if len(recent) < count:
            raise CheckpointError(_too_few(run_dir, mode, count, [s for s, _ in recent], newest))
        chosen = recent[-count:]
    else:
        scored = [(s, p) for s, p in found if s.value is not None]
        if len(scored) < count:
            raise CheckpointError(_too_few(run_dir, mode, count, [s for s, _ in scored], newest))
        sign = 1.0 if higher else -1.0
        ranked = sorted(scored, key=lambda item: (sign * item[0].value, item[0].step))  # the best last
        chosen = sorted(ranked[len(ranked) - count :], key=lambda item: item[0].step)
    return [s for s, _ in chosen], [p for _, p in chosen], metric


def _model_of(payload: Mapping[str, Any]) -> dict[str, Any]:
    model = dict((payload.get("config") or {}).get("model") or {})
    model.pop("pretrained", None)  # where the first weights came from, not what the model is
    return model


def _check_alike(sources: Sequence[Source], payloads: Sequence[Mapping[str, Any]]) -> list[str]:
    """Refuse, naming both files, checkpoints of different runs, models, classes or
    weights; returns the weights they hold (``model``, ``ema``, ...)."""
    last, newest = sources[-1], payloads[-1]
    kinds = weights_in(newest)
    run_of = ((newest.get("config") or {}).get("trainer") or {}).get("run_dir")
    for source, payload in zip(sources[:-1], payloads[:-1], strict=True):
        pair = f"{source.path} and {last.path}"
        other_run = ((payload.get("config") or {}).get("trainer") or {}).get("run_dir")
        if other_run != run_of:
            raise CheckpointError(f"{pair} are checkpoints of different runs ({other_run} and {run_of})")
        if _model_of(payload) != _model_of(newest):
            raise CheckpointError(
                f"{pair} are checkpoints of different models ({_model_of(payload)} and {_model_of(newest)})"
            )
        if payload.get("classes") != newest.get("classes"):
            raise CheckpointError(f"{pair} were trained on different class names: their weights mean other classes")
        if weights_in(payload) != kinds:
            raise CheckpointError(
                f"{pair} hold different weights ({', '.join(weights_in(payload))} and {', '.join(kinds)})"
            )
        for kind in kinds:
            mine, theirs = select_weights(payload, kind, source.path), select_weights(newest, kind, last.path)
            problems = weight_problems(mine, theirs)
            problems += [
                f"{name} is {mine[name].dtype} vs {tensor.dtype}"
                for name, tensor in theirs.items()
                if isinstance(tensor, torch.Tensor) and name in mine and mine[name].dtype != tensor.dtype
            ][:1]
            if problems or list(mine) != list(theirs):
                detail = "; ".join(problems) or "their weights come in another order"
                raise CheckpointError(f"{pair}: their {kind} weights differ ({detail})")
    return kinds


def average_checkpoints(
    sources: Sequence[Source], payloads: Sequence[Mapping[str, Any]], mode: str, metric: str | None = None
) -> dict[str, Any]:
    """The checkpoint that averages ``payloads`` (of ``sources``, oldest first): the
    newest one with each set of weights averaged, its training state left out, and
    ``"averaged"`` saying what it averages."""
    kinds = _check_alike(sources, payloads)
    newest = payloads[-1]
    out = {k: v for k, v in newest.items() if k not in _TRAINING_ONLY and k not in ("format", "format_version")}

    def mean(kind: str) -> dict[str, Any]:
        return average_state_dicts([select_weights(p, kind, s.path) for s, p in zip(sources, payloads, strict=True)])

    out["model"] = mean("model")
    out["optimizer"], out["schedulers"] = None, []
    plugins = {}
    for name, record in (newest.get("plugins") or {}).items():
        kind = record.get("weights")
        if kind in kinds and kind != "model":
            record = {**record, "state": {**record["state"], "weights": mean(kind)}}
        plugins[name] = record
    out["plugins"] = plugins
    out["averaged"] = {
        "mode": mode,
        "count": len(sources),
        "metric": metric,
        "weights": kinds,
        "sources": [{**asdict(s), "path": str(s.path.resolve())} for s in sources],
    }
    return out


def average_run(
    run_dir: str | Path,
    output: str | Path,
    *,
    last: int | None = None,
    best: int | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Average the ``last`` most recent or ``best`` best checkpoints of ``run_dir``
    into ``output`` (written atomically; an existing file only with ``overwrite``,
    never a checkpoint of the run). Returns the ``"averaged"`` record with the file."""
    if (last is None) == (best is None):
        raise ConfigError("average: give one of --last N and --best N")
    mode, count = ("last", last) if last is not None else ("best", best)
    output = check_output(output, run_dir, overwrite)
    sources, payloads, metric = choose_sources(run_dir, mode, count)  # type: ignore[arg-type]
    if output.exists() and any(output.samefile(s.path) for s in sources):
        raise ConfigError(f"-o {output} is a checkpoint being averaged; give another file")
    payload = average_checkpoints(sources, payloads, mode, metric)
    save_checkpoint(payload, output)
    return {**payload["averaged"], "file": str(output)}
