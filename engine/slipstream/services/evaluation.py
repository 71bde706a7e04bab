"""Evaluation at an interval and at the end of the run (none without an interval):
the run's metric plugins (by default loss, top-1 and, with at least 5 classes, top-5
accuracy) over the eval data, reduced across ranks."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from slipstream.duration import Duration
from slipstream.errors import ConfigError
from slipstream.hookspecs import hookimpl
from slipstream.interval import RunInterval
from slipstream.plugins.metric import MetricSet, parse_metrics
from slipstream.run.directory import RunDir, atomic_write_text, strict_json
from slipstream.services.batches import check_pair, to_device
from slipstream.services.eval_metrics import logits_of
from slipstream.services.steps import not_logits
from slipstream.state import State

# How to turn evaluation off, in the config and in Python.
EVALUATION_OFF = "turn evaluation off (trainer.eval_interval: null; eval_interval=None in Python)"


class Evaluator:
    name = "engine.evaluation"

    def __init__(
        self,
        hooks: Any,
        interval: Duration | str | None = "1ep",
        prepare: Callable[[State], None] | None = None,
        guard: Callable[[State], bool] | None = None,
        metrics: MetricSet | None = None,
        write_tables: Callable[[State, dict[str, Any]], None] | None = None,
    ) -> None:
        """``guard``: asked before each evaluation the interval schedules; False
        (the run diverged) skips it. ``metrics``: the run's (None: the defaults);
        ``write_tables`` writes what the file metrics (confusion_matrix) computed."""
        self.hooks = hooks
        self.guard = guard or (lambda state: True)
        # The loop's explicit input step (normalisation), run after eval_batch_start.
        self.prepare = prepare or (lambda state: None)
        self.interval = RunInterval(interval)
        self._last_eval_batch: int | None = None
        self._samples = 0  # seen by the last evaluation
        self.metrics = metrics if metrics is not None else MetricSet(parse_metrics(None))
        self.write_tables = write_tables
        self.tables: dict[str, Any] = {}  # the file metrics' last values (a confusion matrix)
        self._per_set: dict[str, MetricSet] = {}  # the metrics of each evaluation set after the first

    @hookimpl
    def fit_start(self, state: State) -> None:
        self.interval.start(state)
        if state.eval_metrics:  # a resume whose log evaluated its checkpoint's step
            self._last_eval_batch = state.timestamp.batch

    @hookimpl
    def batch_end(self, state: State) -> None:
        # The last batch is evaluated by fit_end, once.
        if not self.interval.mid_epoch or state.is_done():
            return
        if self.interval.due_at_batch_end(state) and self.guard(state):
            self.evaluate(state)

    @hookimpl
    def epoch_end(self, state: State) -> None:
        if self.interval.due_at_epoch_end(state) and self.guard(state):
            self.evaluate(state)

    @hookimpl(tryfirst=True)
    def fit_end(self, state: State) -> None:
        # The final evaluation comes before every other fit_end, so plugins see
        # the final metrics there. No interval means no evaluation at all. An
        # interrupted run goes straight to its checkpoint (a scheduler's grace period
        # is short); diverged weights are not worth evaluating.
        if state.stop_status in ("interrupted", "diverged"):
            return
        if self.interval.enabled and self._last_eval_batch != state.timestamp.batch and self.guard(state):
            self.evaluate(state)

    @property
    def samples(self) -> int:
        """The samples the last evaluation saw (on every process together)."""
        return self._samples

    def _nothing_to_evaluate(self, state: State) -> str:
        if self._samples:
            return (
                f"the evaluation data yielded no samples at step {state.timestamp.batch}, after "
                f"{self._samples} at the evaluation before: it can be read only once (an iterator or "
                "generator); pass a DataLoader (or anything iter() can start again)"
            )
        return (
            "the evaluation data yielded no samples; check it (a DataLoader with drop_last=True and "
            f"a batch larger than the dataset yields none), or {EVALUATION_OFF}"
        )

    def evaluate(self, state: State) -> dict[str, float]:
        """Every evaluation set in turn (``state.eval_sets``; none: ``state.eval_loader``
        as ``val``) between one ``eval_start`` and one ``eval_end``, so that a plugin's
        weights (EMA's) are the ones each set measures. The first set's metrics keep their
        bare names in ``state.eval_metrics``, another set's are ``SET/METRIC``."""
        if state.eval_loader is None:
            return {}
        started = time.perf_counter()
        model, hooks = state.model, self.hooks
        saved = state.batch, state.outputs, state.loss, state.eval_loader
        sets = state.eval_sets or {"val": state.eval_loader}
        # Each module's own mode, not only the model's: a plugin may keep part of the
        # model in eval mode (frozen batch-norm statistics) for the whole run.
        modes = [(module, module.training) for module in model.modules()]
        model.eval()
        state.training = False
        try:  # the training state comes back however the evaluation ends
            hooks.eval_start(state=state)
            values: dict[str, float] = {}
            self.tables = {}
            for index, (name, loader) in enumerate(sets.items()):
                state.eval_loader = loader
                numbers, tables = self._evaluate_set(state, self._set_metrics(name, index), name if index else None)
                prefix = f"{name}/" if index else ""
                values.update({prefix + key: value for key, value in numbers.items()})
                self.tables.update({(f"{key}-{name}" if index else key): t for key, t in tables.items()})
            state.eval_metrics = values
            if self.tables and self.write_tables is not None:
                self.write_tables(state, self.tables)
            hooks.eval_end(state=state)
        finally:
            _restore_modes(model, modes)
            state.training = True
            state.batch, state.outputs, state.loss, state.eval_loader = saved
        self._last_eval_batch = state.timestamp.batch
        _keep_best(state.summary, state.eval_metrics)
        if sets:  # every set's final and best values, also a run's only set (its map, f1_macro ...)
            keep_best_per_set(state.summary, state.eval_metrics, list(sets), self.metrics.higher_is_better)
        # Throughput in summary.json is training throughput: evaluation is set apart.
        state.summary["eval_time_s"] = (
            state.summary.get("eval_time_s", 0.0) + time.perf_counter() - started
        )
        return state.eval_metrics

    def _set_metrics(self, name: str, index: int) -> MetricSet:
        """The metrics of evaluation set ``name``: the run's for the first, a copy of
        them (their own states) for each other."""
        if index == 0:
            return self.metrics
        if name not in self._per_set:
            self._per_set[name] = copy.deepcopy(self.metrics)
        return self._per_set[name]

    def _evaluate_set(self, state: State, metrics: MetricSet, name: str | None) -> tuple[dict[str, float], dict]:
        """One set's metrics and tables (``name``: None for the first set)."""
        with torch.no_grad():
            self._evaluate_batches(state, metrics)
        reduce = _all_reduce if dist.is_available() and dist.is_initialized() else None
        if reduce is not None and not metrics.eager:
            _agree_on_classes(metrics, state)
        count = metrics.reduce(reduce)
        if not count:  # metrics of nothing would read as a loss of 0 and an accuracy of 0
            message = self._nothing_to_evaluate(state) if name is None else f"evaluation set {name!r}: no samples"
            raise ConfigError(message)
        if name is None:
            self._samples = count
        return metrics.compute()

    def _evaluate_batches(self, state: State, metrics: MetricSet) -> None:
        hooks = self.hooks
        metrics.reset()
        # Samples of this rank that are not a distributed sampler's padding (it repeats
        # samples so that every rank gets as many): None, all of them.
        left = real_samples(state.eval_loader)
        for batch in state.eval_loader:
            state.batch = to_device(batch, state.device)
            check_pair(state.batch, "evaluation")
            hooks.eval_batch_start(state=state)
            self.prepare(state)
            state.outputs = hooks.forward(state=state)
            outputs, targets = state.outputs, state.batch[1]
            logits = logits_of(outputs)
            if not isinstance(logits, torch.Tensor):
                fix = "return the logits from forward in eval mode (or a tuple whose first item they are)"
                raise ConfigError(not_logits(outputs, "the evaluation", fix))
            if metrics.num_classes != logits.shape[1]:  # the first evaluation, or a new head
                metrics.loss_fn = state.loss_fn
                metrics.build(logits.shape[1], state.device)
            if left is not None:
                keep, left = max(0, min(left, len(logits))), left - len(logits)
                if keep < len(logits):
                    outputs, logits, targets = _first(outputs, keep), logits[:keep], targets[:keep]
            if len(logits):
                metrics.update(outputs, logits, targets, class_indices(targets, logits))
            hooks.eval_batch_end(state=state)


def write_tables(state: State, tables: dict[str, Any]) -> None:
    """Each table metric's value (a confusion matrix) as a file of the run directory,
    one per evaluation: ``eval/<metric>-ba<step>.json``."""
    paths = RunDir(state.run_dir)
    ts = state.timestamp
    for name, table in tables.items():
        record = {"metric": name, "step": ts.batch, "epoch": state.epochs_done(), "value": table}
        atomic_write_text(paths.eval_table(name, ts.batch), strict_json(record) + "\n")


def _agree_on_classes(metrics: MetricSet, state: State) -> None:
    """Metrics built at the first batch (the class count unknown before it) on a rank
    that saw none would leave it out of the reduction's shape: every rank builds them
    for the class count the others saw (one small all-reduce per evaluation, only then)."""
    classes = torch.tensor([metrics.num_classes or 0], device=state.device)
    dist.all_reduce(classes, op=dist.ReduceOp.MAX)
    if metrics.num_classes is None and int(classes.item()) > 0:
        metrics.loss_fn = state.loss_fn
        metrics.build(int(classes.item()), state.device)


def _all_reduce(tensor: torch.Tensor) -> None:
    dist.all_reduce(tensor)


def _keep_best(summary: dict[str, Any], metrics: dict[str, float]) -> None:
    """The best accuracies so far in the summary (the final ones are the eval record's)."""
    for key in ("accuracy", "accuracy_top5"):
        if key in metrics:
            summary[f"best_{key}"] = max(summary.get(f"best_{key}") or 0.0, metrics[key])
    if "accuracy_top5" in metrics:
        summary["accuracy_top5"] = metrics["accuracy_top5"]


def keep_best_per_set(
    summary: dict[str, Any], metrics: dict[str, float], sets: list[str], higher: Callable[[str], bool]
) -> None:
    """``summary["eval_sets"]``: each evaluation set's final metrics and the best of each
    so far (by its plugin's direction), by set name, the first set's too."""
    out = summary.setdefault("eval_sets", {})
    for index, name in enumerate(sets):
        prefix = f"{name}/" if index else ""
        final = {
            key[len(prefix) :]: value
            for key, value in metrics.items()
            if (key.startswith(prefix) if index else "/" not in key)
        }
        entry = out.setdefault(name, {"final": {}, "best": {}})
        entry["final"] = final
        for key, value in final.items():
            old = entry["best"].get(key)
            if value == value and (old is None or (value > old if higher(key) else value < old)):
                entry["best"][key] = value


def eval_sets(eval_data: Any) -> tuple[Any, dict[str, Any]]:
    """A Trainer's ``eval_data`` as its first loader and every set by name: a mapping of
    names to loaders is several evaluation sets, anything else one named ``val``."""
    if eval_data is None:
        return None, {}
    if not isinstance(eval_data, Mapping):
        return eval_data, {"val": eval_data}
    if not eval_data:
        raise ConfigError("eval_data: an empty mapping of evaluation sets; give at least one, or None")
    for name in eval_data:
        if not isinstance(name, str) or not name or "/" in name:
            raise ConfigError(
                f"eval_data: evaluation set names are non-empty strings without '/' (SET/METRIC names "
                f"a set's metric), got {name!r}"
            )
    return next(iter(eval_data.values())), dict(eval_data)


def real_samples(loader: Any) -> int | None:
    """How many of the samples ``loader`` yields on this rank are real: torch's
    ``DistributedSampler`` (without drop_last) pads the dataset to a multiple of the
    world size with repeated samples, each the last one of its rank; counted, they would
    weigh twice. None: no padding (Slipstream's own sampler splits without any)."""
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, DistributedSampler) or sampler.drop_last or sampler.num_replicas < 2:
        return None
    try:
        total = len(sampler.dataset)  # type: ignore[arg-type]
    except TypeError:
        return None
    return len(range(sampler.rank, total, sampler.num_replicas))


def _first(outputs: Any, keep: int) -> Any:
    """What the model returned, cut to its first ``keep`` samples."""
    if isinstance(outputs, torch.Tensor):
        return outputs[:keep]
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(_first(item, keep) for item in outputs)
    return outputs


def class_indices(targets: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Targets as class indices for accuracy: class probabilities (one-hot or soft
    labels, of the logits' shape) become their most likely class."""
    if targets.is_floating_point() and targets.shape == logits.shape:
        return targets.argmax(dim=1)
    if targets.is_floating_point():
        raise ConfigError(
            f"evaluation targets of shape {tuple(targets.shape)} and dtype {targets.dtype} are neither class "
            f"indices (integers) nor class probabilities of the logits' shape {tuple(logits.shape)}"
        )
    return targets


def _restore_modes(model: torch.nn.Module, modes: list[tuple[torch.nn.Module, bool]]) -> None:
    """Put back the mode each module had: ``train()`` on the model (a model may override
    it), then on each module left in another mode, parents before children."""
    model.train(modes[0][1])
    for module, training in modes:
        if module.training != training:
            module.train(training)
