"""The assembly of a run: the engine's services and the run's plugins on one plugin
manager, in the order that decides who acts first, and the hook checks.

pluggy calls the plugin registered last first. Callbacks go in first (the first given
last, so it is called first), then the engine's services, then the algorithms (the
first in the resolved order last, so its events fire first and its step wrappers are
outermost): at each event algorithms act, then the engine records, then callbacks
observe.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slipstream import hookspecs
from slipstream.config.options import TrainerOptions
from slipstream.plugins.discovery import check_callbacks_observe, check_hook_names, unmarked_hooks
from slipstream.plugins.dispatch import PluginManager, check_step_implementations, plugin_manager
from slipstream.plugins.metric import MetricSet, parse_metrics
from slipstream.services import (
    Checkpointer,
    DefaultSteps,
    Evaluator,
    MetricsLogger,
    Normalize,
    ProgressBar,
    RunSummary,
    TargetAccuracy,
    Utilization,
)
from slipstream.services.divergence import DivergenceMonitor
from slipstream.services.evaluation import write_tables
from slipstream.services.losses import TrainLosses
from slipstream.state import State

Records = Callable[[], list[dict[str, Any]]]


@dataclass
class Services:
    """The engine's own plugins of one run."""

    defaults: DefaultSteps
    summary: RunSummary
    losses: TrainLosses
    divergence: DivergenceMonitor
    checkpointer: Checkpointer
    metrics_log: MetricsLogger
    utilization: Utilization
    target: TargetAccuracy | None
    normalize: Normalize
    evaluator: Evaluator


def assemble(
    options: TrainerOptions,
    *,
    run_dir: Path,
    write: bool,
    algorithms: Sequence[Any],
    callbacks: Sequence[Any],
    algorithm_records: Records,
    callback_records: Records,
    checkpoint_payload: Callable[[State], dict[str, Any]],
    normalize: tuple[Sequence[float], Sequence[float]] | None,
    peak: dict[str, float] | None,
    verbose: bool,
    metrics: MetricSet | None = None,
) -> tuple[PluginManager, Services]:
    """The run's plugin manager with every plugin registered and checked. ``write``:
    this process writes the run's files (global rank 0)."""
    pm = plugin_manager(hookspecs.PROJECT, hookspecs)
    metrics = metrics if metrics is not None else MetricSet(parse_metrics(None))
    for callback in reversed(callbacks):
        pm.register(callback, name=callback.name)
    defaults = DefaultSteps(options.ddp)
    pm.register(defaults, name=DefaultSteps.name)
    utilization = Utilization(peak, verbose=verbose)
    target = None
    if options.target_accuracy is not None:
        metric = options.target_metric  # as the eval records key it (Trainer: _metrics)
        target = TargetAccuracy(
            options.target_accuracy, options.stop_at_target, metric, metrics.higher_is_better(metric)
        )
    summary = RunSummary(
        run_dir,
        algorithm_records,
        callback_records=callback_records,
        utilization=utilization,
        target=target,
        write=write,
    )
    pm.register(summary, name=RunSummary.name)
    # The batches' losses, read by the metrics log and before each checkpoint; the
    # divergence monitor looks at every read.
    losses = TrainLosses()
    divergence = DivergenceMonitor(losses, options.on_nonfinite)
    metrics_log = MetricsLogger(
        run_dir, options.log_interval, write=write, utilization=utilization, hooks=pm.hook, losses=losses
    )

    def before_checkpoint(state: State) -> bool:
        # The metrics log written as far as the checkpoint reaches (a resume from it
        # finds every record before it, the run's last one included), then the
        # divergence check, whose False means no checkpoint of the bad weights.
        metrics_log.log_final(state)
        metrics_log.flush()
        return divergence.check(state)

    checkpointer = Checkpointer(
        run_dir,
        checkpoint_payload,
        options.checkpoint_interval,
        options.checkpoint_keep,
        write=write,
        guard=before_checkpoint,
        best_metric=options.best_metric,
        keep_best=options.keep_best,
        best_higher=metrics.higher_is_better(options.best_metric or ""),
    )
    pm.register(checkpointer, name=Checkpointer.name)
    pm.register(losses, name=TrainLosses.name)
    if options.progress_bar and write:  # registered before the metrics log: called after it
        pm.register(ProgressBar(metrics=metrics_log), name=ProgressBar.name)
    pm.register(metrics_log, name=MetricsLogger.name)
    # On every rank (not only the writer), so that all ranks' clocks leave out the same
    # counting time and a target stops them all at the same batch.
    pm.register(utilization, name=Utilization.name)
    if target is not None:
        target.metrics = metrics_log  # the eval record's elapsed_s
        pm.register(target, name=TargetAccuracy.name)
    # Not a hook implementation: an explicit step after batch_start, last whatever
    # plugins do.
    normalizer = Normalize(*normalize) if normalize is not None else Normalize()
    evaluator = Evaluator(
        pm.hook,
        options.eval_interval,
        normalizer.prepare,
        guard=divergence.before_evaluation,
        metrics=metrics,
        write_tables=write_tables if write else None,
    )
    pm.register(evaluator, name=Evaluator.name)
    for algo in reversed(algorithms):
        pm.register(algo, name=algo.name)
    check_hooks(pm, defaults)
    if write:
        warn_unmarked_hooks(pm, [*algorithms, *callbacks])
    services = Services(
        defaults, summary, losses, divergence, checkpointer, metrics_log, utilization, target, normalizer, evaluator
    )
    return pm, services


def check_hooks(pm: PluginManager, defaults: DefaultSteps) -> None:
    """Hook names that exist, callbacks that only observe, at most one plugin replacing
    each step, and every step's results checked (again after ``init``, which may
    register helpers)."""
    check_hook_names(pm)
    check_callbacks_observe(pm)
    check_step_implementations(pm, defaults)


def warn_unmarked_hooks(pm: PluginManager, plugins: Sequence[Any]) -> None:
    for plugin in plugins:
        for method in unmarked_hooks(pm, plugin):
            warnings.warn(
                f"slipstream: plugin {plugin.name!r} ({type(plugin).__name__}) defines {method!r}, "
                "the name of a hook, without @hookimpl, so the engine never calls it; mark it "
                "@hookimpl (from slipstream import hookimpl), or rename it if it is no hook",
                stacklevel=4,
            )
