"""Evaluation metrics as plugins: entry-point group ``slipstream.metrics``.

A metric plugin is a class with ``update(outputs, targets)``, ``compute()`` (a number,
or a dict of named numbers) and ``reset()``; a torchmetrics ``Metric`` is one. Optional
class attributes say more: ``higher_is_better`` (default true: what ``best_metric``
keeps), ``tasks`` (the targets it applies to: ``"multiclass"`` class indices,
``"multilabel"`` multi-hot vectors; default both), ``min_classes``, ``raw`` (true: given
what the model returned and the targets as they came, not logits and class indices)
and ``to_file`` (true: ``compute()`` returns a table written to a file of the run
directory at each evaluation, not a number of the eval records).

The engine builds each as ``cls(**kwargs)``, adding ``num_classes`` and ``loss_fn``
where the constructor takes them and the config did not give them. Names come from the
installed entry points (``slipstream metrics`` lists them); ``package.module:Class``
names a class by its import path.
"""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from slipstream.config.imports import import_object, is_import_path
from slipstream.errors import ConfigError, did_you_mean
from slipstream.plugins.discovery import discover

METRICS_GROUP = "slipstream.metrics"
# The run's targets: class indices or class probabilities (single-label); multi-hot
# vectors (multi-label) once a dataset declares them.
TASKS = ("multiclass", "multilabel")
# evaluation.metrics: null evaluates these (accuracy_top5 with 5 classes or more);
# a multi-label run's (no single true class to rank).
DEFAULT_METRICS = ("loss", "accuracy", "accuracy_top5")
MULTILABEL_DEFAULTS = ("loss", "map", "f1_samples")
KEY = "evaluation.metrics"


@dataclass
class MetricSpec:
    """One entry of ``evaluation.metrics``: the name its values are recorded under, the
    class (or a ready instance, from Python) and its keyword arguments."""

    name: str
    source: str  # what the user wrote: an installed name or an import path
    cls: type
    kwargs: dict[str, Any] = field(default_factory=dict)
    instance: Any = None
    optional: bool = False  # a default that a run of too few classes leaves out

    def attribute(self, name: str, default: Any) -> Any:
        value = getattr(self.instance if self.instance is not None else self.cls, name, default)
        return default if value is None else value

    @property
    def higher_is_better(self) -> bool:
        return bool(self.attribute("higher_is_better", True))

    @property
    def to_file(self) -> bool:
        return bool(self.attribute("to_file", False))


def installed_metrics() -> dict[str, Any]:
    """The metrics installed in the ``slipstream.metrics`` group, by name: their
    :class:`~slipstream.plugins.discovery.PluginInfo`, not imported."""
    return discover(load=False, group=METRICS_GROUP, base=object)


# `slipstream metrics` lists the built-ins without importing them (torchmetrics' import
# costs a second): their classes' docstrings, checked equal by tests/test_metrics.py.
BUILTIN_SUMMARIES = {
    "loss": "Mean loss per sample: the run's loss function (cross-entropy by default).",
    "accuracy": "Top-1 accuracy: the share of samples whose highest logit is the target class.",
    "accuracy_top5": "Top-5 accuracy: the share of samples whose target is among the 5 highest logits.",
    "balanced_accuracy": "Balanced accuracy: the mean over classes of each class's recall.",
    "f1_macro": "F1 score of each class, averaged over classes.",
    "precision_macro": "Precision of each class, averaged over classes.",
    "recall_macro": "Recall of each class, averaged over classes (equal to balanced_accuracy).",
    "calibration_error": "Expected calibration error (ECE): confidence against accuracy in 15 bins, L1.",
    "confusion_matrix": "Confusion matrix (rows: target class, columns: predicted), written to a file per evaluation.",
    "map": "Multi-label mean average precision (mAP): average precision per label, averaged.",
    "f1_samples": "Multi-label F1 per sample, averaged over samples (scikit-learn's average='samples').",
}


def listed_metrics(check: bool = False) -> list[Any]:
    """What ``slipstream metrics`` lists: each installed metric's PluginInfo, its summary
    the class docstring's first line; with ``check`` each is imported and a failure
    recorded."""
    infos = list(installed_metrics().values())
    for info in infos:
        info.check_module()
        if check and info.error is None:
            try:
                cls = metric_class(info.name)
            except ConfigError as exc:
                info.error = str(exc).split("failed to load: ", 1)[-1]
            else:
                if not _is_metric(cls):
                    info.error = f"{info.target} has no update(), compute() and reset()"
                info.description = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        elif info.distribution == "slipstream" and info.name in BUILTIN_SUMMARIES:
            info.description = BUILTIN_SUMMARIES[info.name]
    return infos


# The engine's own metrics, as its pyproject.toml registers them (tests/test_metrics.py
# checks the two agree): found without reading every installed distribution's entry
# points, which cost 0.07-0.2 s a time, three times a Trainer (a third of a tiny run).
ENGINE_METRICS = {
    "loss": "slipstream.services.eval_metrics:Loss",
    "accuracy": "slipstream.services.eval_metrics:Accuracy",
    "accuracy_top5": "slipstream.services.eval_metrics:AccuracyTop5",
    "f1_samples": "slipstream.services.eval_metrics:F1Samples",
    "balanced_accuracy": "slipstream.services.classification_metrics:BalancedAccuracy",
    "f1_macro": "slipstream.services.classification_metrics:F1Macro",
    "precision_macro": "slipstream.services.classification_metrics:PrecisionMacro",
    "recall_macro": "slipstream.services.classification_metrics:RecallMacro",
    "calibration_error": "slipstream.services.classification_metrics:CalibrationError",
    "confusion_matrix": "slipstream.services.classification_metrics:ConfusionMatrix",
    "map": "slipstream.services.classification_metrics:MeanAveragePrecision",
}


def metric_class(name: str) -> type:
    """The class installed as metric ``name``, or a ConfigError listing the installed ones."""
    if name in ENGINE_METRICS:
        return import_object(ENGINE_METRICS[name], KEY)
    installed = installed_metrics()
    info = installed.get(name)
    if info is None:
        listed = ", ".join(sorted(installed)) or "none"
        raise ConfigError(
            f"{KEY}: unknown metric {name!r}{did_you_mean(name, installed)}; installed: {listed} "
            "(`slipstream metrics`), or an import path package.module:Class"
        )
    if info.error is None and info.entry_point is not None:
        try:
            info.cls = info.entry_point.load()
        except Exception as exc:  # a plugin's import may fail in any way
            info.error = f"{type(exc).__name__}: {exc}"
        info.entry_point = None
    if info.error is not None or info.cls is None:
        raise ConfigError(f"{KEY}: metric {name!r} ({info.distribution}) failed to load: {info.error}")
    return info.cls


def snake_case(name: str) -> str:
    """A class name as a record key.

    >>> snake_case("MulticlassAUROC"), snake_case("TopKHits")
    ('multiclass_auroc', 'top_k_hits')
    """
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def _is_metric(obj: Any) -> bool:
    return all(callable(getattr(obj, method, None)) for method in ("update", "compute", "reset"))


def default_metrics(task: str = "multiclass") -> tuple[str, ...]:
    """What ``evaluation.metrics: null`` evaluates for the run's targets (``task``)."""
    return MULTILABEL_DEFAULTS if task == "multilabel" else DEFAULT_METRICS


def data_task(data: Any) -> str:
    """The targets ``data`` (a loader, a dataset, or a mapping of either by set name)
    carries: the ``task`` its dataset declares, found through the wrappers' ``.dataset``
    (a loader's, a crop's); ``multiclass`` where none declares one."""
    if isinstance(data, Mapping):
        data = next(iter(data.values()), None)
    for _ in range(5):  # a loader, a crop or subset, the dataset: a few levels at most
        task = getattr(data, "task", None)
        if isinstance(task, str):
            return task
        data = getattr(data, "dataset", None)
        if data is None:
            break
    return "multiclass"


def task_best_metric(metric: str | None, task: str) -> str | None:
    """A metric a run of ``task`` reads (``trainer.best_metric``, ``target_metric``, a
    callback's monitor): their default ``accuracy`` is read as ``map`` in a multi-label
    run, which evaluates no accuracy."""
    return "map" if task == "multilabel" and metric == "accuracy" else metric


def parse_metrics(items: Sequence[Any] | None, task: str = "multiclass") -> list[MetricSpec]:
    """``evaluation.metrics`` (or a Trainer's ``metrics=``) as specs: each item an
    installed name, an import path, a one-key mapping of either to its keyword
    arguments, or (in Python) a metric class or instance. None: the defaults of the
    run's ``task`` (:func:`default_metrics`)."""
    if items is None:
        names = default_metrics(task)
        return [MetricSpec(n, n, metric_class(n), optional=n == "accuracy_top5") for n in names]
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise ConfigError(f"{KEY} must be a list of metric names, e.g. [accuracy, f1_macro], got {items!r}")
    specs: list[MetricSpec] = []
    for item in items:
        spec = _parse_item(item)
        if any(s.name == spec.name for s in specs):
            raise ConfigError(f"{KEY}: {spec.name!r} is given twice")
        specs.append(spec)
    if not specs:
        raise ConfigError(f"{KEY} is empty: name at least one metric, or null for the defaults")
    return specs


def _parse_item(item: Any) -> MetricSpec:
    kwargs: dict[str, Any] = {}
    if isinstance(item, Mapping):
        if len(item) != 1:
            raise ConfigError(
                f"{KEY}: {dict(item)!r} must map one metric to its keyword arguments, "
                "e.g. {calibration_error: {n_bins: 10}}"
            )
        ((item, options),) = item.items()
        if options is not None and not isinstance(options, Mapping):
            raise ConfigError(f"{KEY}: the options of {item!r} must be a mapping of keywords, got {options!r}")
        kwargs = dict(options or {})
    if isinstance(item, str):
        cls = import_object(item, KEY) if is_import_path(item) else metric_class(item)
        if not (isinstance(cls, type) and _is_metric(cls)):
            raise ConfigError(f"{KEY}: {item!r} is not a metric: a class with update(), compute() and reset()")
        name = item if not is_import_path(item) else _own_name(cls)
        return MetricSpec(name, item, cls, kwargs)
    if isinstance(item, type) and _is_metric(item):
        return MetricSpec(_own_name(item), item.__name__, item, kwargs)
    if _is_metric(item) and not isinstance(item, type):
        return MetricSpec(_own_name(type(item), item), type(item).__name__, type(item), instance=item)
    raise ConfigError(
        f"{KEY}: {item!r} is not a metric: give an installed name (`slipstream metrics`), an import "
        "path package.module:Class, or (in Python) a class or instance with update(), compute() and reset()"
    )


def _own_name(cls: type, instance: Any = None) -> str:
    name = getattr(instance if instance is not None else cls, "name", None)
    return name if isinstance(name, str) and name else snake_case(cls.__name__)


def check_applies(specs: Sequence[MetricSpec], task: str = "multiclass", num_classes: int | None = None) -> None:
    """Refuse a metric that does not apply to the run's targets (mAP of class indices)
    or to its class count (top-5 of 4 classes). A default leaves itself out instead."""
    for spec in specs:
        tasks = spec.attribute("tasks", TASKS)
        if task not in tasks:
            targets = "class indices (single-label)" if task == "multiclass" else "multi-hot (multi-label)"
            raise ConfigError(
                f"{KEY}: {spec.name!r} applies to {' and '.join(tasks)} targets; this run's are {targets}"
            )
        low = spec.attribute("min_classes", 1)
        if num_classes is not None and num_classes < low and not spec.optional:
            raise ConfigError(f"{KEY}: {spec.name!r} needs at least {low} classes; the run has {num_classes}")


def split_set(metric: str) -> tuple[str | None, str]:
    """``SET/METRIC`` as its set and metric; a bare metric's set is None (the first)."""
    where, _, name = metric.rpartition("/")
    return (where or None), name


def record_key(metric: str | None, sets: Sequence[str] = ("val",)) -> str | None:
    """The eval record's key for ``metric``: the first set's metrics are recorded under
    their bare names (as before there were several sets), so ``val/accuracy`` of a first
    set ``val`` is ``accuracy``; another set's keep their ``SET/`` prefix."""
    if metric is None:
        return None
    where, name = split_set(metric)
    return name if sets and where == sets[0] else metric


def check_monitored(
    metric: str | None,
    specs: Sequence[MetricSpec],
    key: str = "trainer.best_metric",
    sets: Sequence[str] = ("val",),
    off: str | None = None,
) -> None:
    """``metric`` (what best.pt keeps, or a monitor) is one the evaluation records: a
    metric's name, or ``name_key`` of one whose compute() returns a dict; ``SET/METRIC``
    for one of the evaluation sets ``sets`` (a bare name: the first set's). ``off``: the
    key whose null turns off what reads it (``key`` itself unless said)."""
    if metric is None:
        return
    if not isinstance(metric, str) or not metric:
        names = ", ".join(s.name for s in specs if not s.to_file)
        raise ConfigError(f"{key} must name one evaluated metric ({names}, or SET/METRIC), got {metric!r}")
    given, (where, metric) = metric, split_set(metric)
    if where is not None and where not in sets:
        raise ConfigError(
            f"{key}={given!r}: no evaluation set is named {where!r}{did_you_mean(where, list(sets))}; "
            f"the sets evaluated: {', '.join(sets)} (data.eval_sets)"
        )
    names = [s.name for s in specs if not s.to_file]
    if metric in names or any(metric.startswith(f"{n}_") for n in names):
        return
    raise ConfigError(
        f"{key}={given!r} is not evaluated{did_you_mean(metric, names)}; the evaluation records "
        f"{', '.join(names)} ({KEY}), or set {off or key}=null"
    )


def run_metrics(
    items: Sequence[Any] | None,
    *,
    loss_fn: Any,
    num_classes: int | None,
    device: torch.device | str,
    evaluates: bool,
    best_metric: str | None,
    target_accuracy: float | None,
    prefix: str = "",
    monitors: Mapping[str, str | None] | None = None,
    sets: Sequence[str] = ("val",),
    task: str = "multiclass",
    target_metric: str = "accuracy",
) -> MetricSet:
    """A run's metrics (``items``: ``evaluation.metrics``, a Trainer's ``metrics=``),
    built where the class count is known, and checked against what reads them: the
    metric ``best_metric`` keeps, those callbacks monitor (``monitors``: option key to
    metric, e.g. ``callbacks.early_stopping.monitor``), and ``target_metric``, which
    ``target_accuracy`` is read from."""
    specs = parse_metrics(items, task)  # task: the targets' (data_task), for defaults and refusals
    metrics = MetricSet(specs, loss_fn=loss_fn, task=task, num_classes=num_classes, device=device)
    if evaluates:
        check_monitored(best_metric, specs, f"{prefix}best_metric", sets)
        for key, monitored in (monitors or {}).items():
            check_monitored(monitored, specs, key, sets)
        if target_accuracy is not None:
            check_monitored(target_metric, specs, f"{prefix}target_metric", sets, f"{prefix}target_accuracy")
    return metrics


def _accepts(cls: type, keyword: str) -> bool:
    try:
        parameters = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
    return keyword in parameters  # named: a **kwargs that passes on to torch would refuse it


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def as_numbers(name: str, value: Any) -> dict[str, float]:
    """A metric's ``compute()`` as record keys and floats: a number under ``name``, a
    dict's numbers under ``name_key``; anything else is a ConfigError naming the metric."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype == torch.bool:
        return {name: float(value.reshape(()).item())}
    if _is_number(value):
        return {name: float(value)}
    if isinstance(value, Mapping) and value:
        out: dict[str, float] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                break
            number = as_numbers(f"{name}_{key}", item) if not isinstance(item, Mapping) else None
            if number is None:
                break
            out.update(number)
        else:
            return out
    shape = f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else ""
    raise ConfigError(
        f"{KEY}: {name!r}.compute() returned {type(value).__name__}{shape}; a metric returns a number "
        "or a dict of named numbers (a table goes to a file: to_file = True)"
    )


class MetricSet:
    """The metrics of one run, built for its class count: reset, updated with each
    evaluation batch, computed at its end (states reduced across ranks)."""

    def __init__(
        self,
        specs: Sequence[MetricSpec],
        *,
        loss_fn: Any = None,
        task: str = "multiclass",
        num_classes: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.specs = list(specs)
        self.loss_fn = loss_fn
        self.task = task
        check_applies(self.specs, task, num_classes)
        self.num_classes: int | None = None
        self.metrics: list[tuple[MetricSpec, Any]] = []
        self._raw: list[bool] = []
        self.count = 0  # samples of this rank in the evaluation so far
        self._reduced: dict[int, list[float]] = {}
        # Built before any evaluation, alike on every rank (the class count was known).
        self.eager = num_classes is not None
        if num_classes is not None:
            self.build(num_classes, device)

    def higher_is_better(self, name: str) -> bool:
        name = split_set(name)[1]  # another evaluation set's metric ranks as the first set's
        for spec in self.specs:
            if name == spec.name or name.startswith(f"{spec.name}_"):
                return spec.higher_is_better
        return True

    def build(self, num_classes: int, device: torch.device | str = "cpu") -> None:
        """Construct each metric for ``num_classes`` and check that its compute() gives
        numbers (one update of a made-up batch, then reset): a metric that gives
        something else is refused before any evaluation."""
        check_applies(self.specs, self.task, num_classes)
        built = []
        for spec in self.specs:
            if spec.optional and num_classes < spec.attribute("min_classes", 1):
                continue
            metric = spec.instance if spec.instance is not None else self._construct(spec, num_classes)
            if not callable(getattr(metric, "compute_from", None)):  # the engine's summed ones give floats
                _dry_run(spec, metric, num_classes, self.task)
            if hasattr(metric, "to") and callable(metric.to):
                metric = metric.to(device) or metric
            built.append((spec, metric))
        self.metrics, self.num_classes = built, num_classes
        self._raw = [bool(spec.attribute("raw", False)) for spec, _ in built]  # asked once, not per batch

    def _construct(self, spec: MetricSpec, num_classes: int) -> Any:
        kwargs = dict(spec.kwargs)
        if "num_classes" not in kwargs and _accepts(spec.cls, "num_classes"):
            kwargs["num_classes"] = num_classes
        if "loss_fn" not in kwargs and _accepts(spec.cls, "loss_fn"):
            kwargs["loss_fn"] = self.loss_fn
        if "task" not in kwargs and _accepts(spec.cls, "task"):
            kwargs["task"] = self.task  # the loss: BCE of multi-hot targets
        try:
            return spec.cls(**kwargs)
        except (TypeError, ValueError) as exc:
            given = ", ".join(f"{k}={v!r}" for k, v in spec.kwargs.items())
            raise ConfigError(f"{KEY}: {spec.source}({given}) cannot be built: {exc}") from None

    def reset(self) -> None:
        for _, metric in self.metrics:
            metric.reset()
        self.count = 0

    def update(self, outputs: Any, logits: torch.Tensor, targets: torch.Tensor, indices: torch.Tensor) -> None:
        """One batch: raw metrics get what the model returned and the targets as they
        came, the others the logits and the targets as class indices (multi-hot 0/1
        integer vectors, in a multi-label run)."""
        if self.task == "multilabel":
            indices = (targets > 0.5).long()  # torchmetrics' multi-label metrics take 0/1 integers
        for (_, metric), raw in zip(self.metrics, self._raw, strict=True):
            if raw:
                metric.update(outputs, targets)
            else:
                metric.update(logits, indices)
        self.count += len(logits)

    def reduce(self, all_reduce: Callable[[torch.Tensor], None] | None) -> int:
        """Sum the engine's summed metrics' states and the sample counts across ranks in
        one ``all_reduce`` (in place; None in one process); torchmetrics syncs its own
        at compute. Returns the samples of all ranks."""
        summed = [m for _, m in self.metrics if callable(getattr(m, "sums", None))]
        device = summed[0].device if summed else "cpu"
        parts = [m.sums().to(device) for m in summed]
        parts.append(torch.tensor([float(self.count)], dtype=torch.float64, device=device))
        flat = torch.cat([p.reshape(-1) for p in parts])
        if all_reduce is not None:
            if flat.device.type == "cpu" and dist_backend() == "nccl":
                flat = flat.to(torch.device("cuda", torch.cuda.current_device()))
            all_reduce(flat)
        values = flat.tolist()  # the evaluation's one copy to the host
        self._reduced = {}
        for metric, part in zip(summed, parts, strict=False):
            self._reduced[id(metric)], values = values[: part.numel()], values[part.numel() :]
        return int(values[0])

    def compute(self) -> tuple[dict[str, float], dict[str, Any]]:
        """The numbers of the eval record, and the tables of the file metrics (after
        :meth:`reduce`)."""
        numbers: dict[str, float] = {}
        files: dict[str, Any] = {}
        with warnings.catch_warnings():
            # A rank that saw no sample: torchmetrics warns that compute() came before update().
            warnings.filterwarnings("ignore", message=".*compute.*before.*update", category=UserWarning)
            for spec, metric in self.metrics:
                reduced = self._reduced.get(id(metric))
                value = metric.compute_from(reduced) if reduced is not None else metric.compute()
                if spec.to_file:
                    files[spec.name] = value.tolist() if isinstance(value, torch.Tensor) else value
                else:
                    numbers.update(as_numbers(spec.name, value))
        return numbers, files


def dist_backend() -> str | None:
    return dist.get_backend() if dist.is_available() and dist.is_initialized() else None


def _one_process() -> bool:
    return False


def _dry_run(spec: MetricSpec, metric: Any, num_classes: int, task: str) -> None:
    """Update ``metric`` with a made-up batch, check compute() returns numbers, reset it."""
    logits = torch.linspace(-1.0, 1.0, 4 * num_classes).reshape(4, num_classes)
    if task == "multilabel":
        targets = (torch.arange(4 * num_classes).reshape(4, num_classes) % 2).long()
    else:
        targets = torch.arange(4) % num_classes
    # Each rank checks its own: no collective here, where another rank may be in none
    # (torchmetrics syncs in compute() whenever a process group is up; sync_on_compute
    # is read only at construction, its distributed_available_fn at every sync).
    syncs = getattr(metric, "distributed_available_fn", None)
    if syncs is not None:
        metric.distributed_available_fn = _one_process
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            metric.update(logits, targets)
            value = metric.compute()
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"{KEY}: {spec.name!r} fails on a batch of {num_classes}-class logits: {exc}") from None
    finally:
        if syncs is not None:
            metric.distributed_available_fn = syncs
    if not spec.to_file:
        as_numbers(spec.name, value)  # only the type is checked: a made-up batch's values mean nothing
    metric.reset()
