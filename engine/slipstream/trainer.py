"""`Trainer`: a plain training loop that fires hooks.

Everything a technique changes happens in a plugin; the loop only moves batches,
calls the step hooks and advances time. A run is put together once, in this order
(docs/architecture.md): the options validated, the process set up
(:mod:`slipstream.run.process`), the plugins built and ordered
(:mod:`slipstream.plugins.registry`), where the run starts from and its directory
(:mod:`slipstream.run.checkpoint`, :mod:`slipstream.run.directory`), then the state,
the engine's services and the plugin manager (:mod:`slipstream.run.assembly`). ``fit``
then chooses the variants, calls ``init``, resumes and runs the loop.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from slipstream import hookspecs
from slipstream.config.options import TrainerOptions, parse_peak_tflops, resolve_normalize
from slipstream.data.loaders import stop_workers
from slipstream.distributed import shared_clock
from slipstream.duration import Duration
from slipstream.errors import ConfigError
from slipstream.interrupts import interrupted_reason, stop_on_signals
from slipstream.plugins.algorithm import Algorithm
from slipstream.plugins.callback import Callback
from slipstream.plugins.discovery import PluginInfo, config_as_dict
from slipstream.plugins.dispatch import bind, bind_event, blame
from slipstream.plugins.metric import data_task, record_key, run_metrics, task_best_metric
from slipstream.plugins.registry import Registry
from slipstream.plugins.variants import choose_run_variants
from slipstream.run.assembly import assemble, check_hooks
from slipstream.run.checkpoint import checkpoint_payload, find_start, resume, written_in
from slipstream.run.directory import RunDir, choose_run_dir, prepare_run_dir
from slipstream.run.preflight import (
    batches_per_epoch,
    check_arguments,
    check_run,
    checked_schedulers,
    why_no_batches,
)
from slipstream.run.process import Process, seed_everything, set_up_process
from slipstream.services.batches import batch_mover, check_pair
from slipstream.services.evaluation import eval_sets as split_eval_sets
from slipstream.services.summary import resume_summary
from slipstream.state import State, unwrap_model


class Trainer:
    """Train ``model`` with ``optimizer`` on ``train_data`` for ``max_duration``.

    ``algorithms`` holds :class:`Algorithm` instances (or installed names, built
    with their default config; one string is read as ``"a,b"`` is on the command
    line); ``callbacks`` the same for :class:`Callback`
    (loggers, profiler, early stopping), called in the order given.
    ``metrics`` are what each evaluation measures (docs/metrics.md): installed names
    (``slipstream metrics``), import paths ``"package.module:Class"``, one-key dicts of
    either to keyword arguments, or metric objects (a torchmetrics ``Metric``); None:
    loss, accuracy and, with 5 classes or more, accuracy_top5.
    ``train_data``/``eval_data`` are any iterables of ``(inputs, targets)`` batches,
    usually DataLoaders (``eval_data`` also a dict of evaluation sets by name); a
    DataLoader whose sampler has ``set_epoch(epoch, start_batch)`` (as Slipstream's own)
    gives an order that depends on the seed and epoch alone and resumes mid-epoch exactly.

    The run-level keywords are the fields of
    :class:`~slipstream.config.options.TrainerOptions` (the config's ``trainer``
    section holds the same names and defaults), or ``options=`` one such object; they
    are kept as ``self.options``, validated, then applied as the CLI applies them
    (threads, determinism, seeds), with ``normalize="auto"`` and a ``config.yaml``
    in the run directory. ``eval_interval=None`` means no evaluation and
    ``checkpoint_interval=None`` no checkpoints.

    ``target_accuracy`` (a fraction in (0, 1]) records ``time_to_target_s`` in the
    summary when ``target_metric`` (``"accuracy"``, ``"SET/accuracy"``, ``"map"``,
    ``"loss"``: reached at or below) reaches it; with ``stop_at_target`` the run ends
    there with status ``target_reached``. ``peak_tflops`` (a number, or a mapping of fp32/bf16/fp16 to
    numbers) is the device's peak for MFU; by default it is probed once per machine.
    ``best_metric`` (``"accuracy"``, ``"loss"``, ``"SET/accuracy"`` or None) is the eval metric whose
    best value ``checkpoints/best.pt`` keeps.

    ``schedulers`` (torch LR schedulers on ``optimizer``) are stepped at the end of
    every epoch, or after every optimizer step with ``scheduler_interval="batch"``
    (Lightning's and Composer's default is the epoch too), and saved in checkpoints.
    The ``stepwise_lr`` algorithm is the config's way to schedule the LR.

    ``autoresume=True`` (with a fixed ``run_dir``) continues the run there from its
    ``latest.pt`` when it has one, as ``load_path`` would, and refuses one whose config
    differs in what changes training; without one the run starts. Fine-tuning:
    ``load_weights_only=True`` takes only the model weights from ``load_path``, leaving
    those matching the globs ``load_ignore_keys`` as initialised, from the weights
    ``load_weights`` names (``"model"``, or a plugin's such as ``"ema"``). See
    docs/workflows.md.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_data: Iterable[Any],
        eval_data: Iterable[Any] | None = None,
        max_duration: str | Duration | None = None,
        algorithms: Sequence[Algorithm | str] = (),
        run_dir: str | Path | None = None,
        *,
        callbacks: Sequence[Callback | str] = (),
        metrics: Sequence[Any] | None = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        schedulers: Sequence[Any] = (),
        config: dict[str, Any] | None = None,
        installed: dict[str, PluginInfo] | Registry | None = None,
        options: TrainerOptions | None = None,
        process: Process | None = None,
        **settings: Any,
    ) -> None:
        eval_data, eval_sets = split_eval_sets(eval_data)  # a mapping of names to loaders: several sets
        check_arguments(model, optimizer, train_data, eval_data, loss_fn)
        schedulers = checked_schedulers(schedulers, optimizer)
        self.options = o = _options(options, settings, max_duration=max_duration, run_dir=run_dir)
        # The command line hands over the process it set up before building data and
        # model; a Trainer made in Python sets it up here.
        process = process or set_up_process(o)
        self.device, rank, world_size = process.device, process.rank, process.world_size
        # Training starts from the seed, however much randomness building the model
        # and data drew: a Python run and a CLI run of one seed train alike.
        seed_everything(o.seed)
        self.max_duration = Duration.parse(o.max_duration)
        self.registry = installed if isinstance(installed, Registry) else Registry(installed)
        self.algorithms, self.callbacks = self.registry.run_plugins(algorithms, callbacks)
        self.verbose = o.verbose and rank == 0
        normalize, note = resolve_normalize(o.normalize, train_data)
        if note and self.verbose:
            print(f"slipstream: {note}", file=sys.stderr)
        loss_fn = loss_fn or nn.CrossEntropyLoss()
        self.metrics = _metrics(metrics, o, model, loss_fn, config, eval_sets, self.device, self.callbacks)
        self.config = config or describe_run(model, optimizer, o, self.algorithms, self.callbacks, metrics)
        self.start = find_start(o, self.config, self.device, verbose=self.verbose)
        self.load_path, self.weights_only = self.start.path, self.start.weights_only
        self.overwrite = o.overwrite or self.start.clear
        self.paths = choose_run_dir(
            o.run_dir, overwrite=self.overwrite, load_path=self.start.continues, weights_from=self.load_path
        )
        self.run_dir = self.paths.root
        self.summary: dict[str, Any] = {}
        check_run(o, train_data, eval_data, model=model, optimizer=optimizer, max_duration=self.max_duration,
                  callbacks=self.callbacks, from_config=config is not None, world_size=world_size,
                  warn=rank == 0)  # fmt: skip
        # Stepped by the loop, not a plugin: the optimizer's LR must have moved before
        # any epoch_end or batch_end hook (a checkpoint) sees the schedulers' state.
        self._epoch_schedulers = list(schedulers) if o.scheduler_interval == "epoch" else []
        self._batch_schedulers = list(schedulers) if o.scheduler_interval == "batch" else []
        self.state = State(
            model=model.to(self.device),
            optimizer=optimizer,
            max_duration=self.max_duration,
            train_loader=train_data,
            eval_loader=eval_data,
            eval_sets=eval_sets,
            device=self.device,
            loss_fn=loss_fn,
            schedulers=list(schedulers),
            seed=o.seed,
            rank=rank,
            world_size=world_size,
            run_dir=self.run_dir,
            config=self.config,
            algorithms=list(self.algorithms),
            callbacks=list(self.callbacks),
        )
        self.state.batches_per_epoch = batches_per_epoch(train_data)
        batch_size = getattr(train_data, "batch_size", None)
        self.state.global_batch_size = batch_size * world_size if batch_size else None
        self.pm, self.services = assemble(
            o,
            run_dir=self.run_dir,
            write=rank == 0,
            algorithms=self.algorithms,
            callbacks=self.callbacks,
            algorithm_records=lambda: self.registry.records(self.algorithms),
            callback_records=lambda: self.registry.records(self.callbacks),
            checkpoint_payload=self._checkpoint_payload,
            normalize=normalize,
            peak=parse_peak_tflops(o.peak_tflops),
            verbose=self.verbose,
            metrics=self.metrics,
        )
        s = self.services
        self.summary_writer, self.metrics_log, self.checkpointer = s.summary, s.metrics_log, s.checkpointer
        self.utilization, self.target, self.evaluator = s.utilization, s.target, s.evaluator
        self.normalize = s.normalize
        self._hooks = SimpleNamespace()
        self._to_device = batch_mover(self.device)
        self._share_clock: Callable[[State], None] | None = None  # set in fit() (shared_clock)

    @property
    def hooks(self) -> SimpleNamespace:
        """Every hook as the loop calls it, bound when the run starts; the per-batch
        events (`hookspecs.BATCH_EVENTS`) are None when nobody implements them."""
        return self._hooks

    def _bind_hooks(self) -> None:
        """Look every hook up once (`slipstream.plugins.dispatch`): plain implementations are
        called directly; a per-batch event nobody implements is None, and the loop
        skips it."""
        for name in (*hookspecs.EVENTS, *hookspecs.STEPS):
            per_batch = name in hookspecs.BATCH_EVENTS
            setattr(self._hooks, name, bind_event(self.pm, name) if per_batch else bind(self.pm, name))

    # -- the run -------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Run to ``max_duration``; returns the summary (also in ``summary.json``).

        SIGINT and SIGTERM end the run after the current batch with a checkpoint
        (status ``interrupted``); a non-finite loss ends it with status ``diverged``
        (``on_nonfinite="stop"``) and no checkpoint of the bad weights.
        """
        state, pm = self.state, self.pm
        if self.verbose:
            order = " -> ".join(a.name for a in self.algorithms) or "none"
            print(f"slipstream: algorithms in order: {order}", file=sys.stderr)
            if self.callbacks:
                print(f"slipstream: callbacks: {', '.join(c.name for c in self.callbacks)}", file=sys.stderr)
            print(f"slipstream: run directory: {self.run_dir}", file=sys.stderr)
        # Told even when quiet: the user must learn that a second signal aborts.
        restore_signals = stop_on_signals(state, verbose=state.rank == 0)
        try:
            finished = self._start()
            if finished is not None:
                # Nothing runs and nothing is written: another final evaluation and a
                # summary of a session that trained nothing would overwrite the run's.
                self.summary = finished
                return self.summary
            # DDP by default; a parallelism plugin may distribute the model itself.
            state.model = pm.hook.wrap_model(state=state)
            self._share_clock = shared_clock(state, self.options)
            self._bind_hooks()
            if state.rank == 0:
                files = self.registry.run_files(
                    [*self.algorithms, *self.callbacks], every_callback=self.overwrite and self.paths.root.is_dir()
                )
                prepare_run_dir(self.paths, overwrite=self.overwrite, load_path=self.start.continues,
                                config=self.config, verbose=self.verbose, plugin_files=files)  # fmt: skip
            # A model handed over in eval mode (evaluated after loading weights) would
            # otherwise train with frozen batch-norm statistics and no dropout.
            state.model.train()
            state.start_clock()
            self._hooks.fit_start(state=state)
            self._loop()
            state.shared_clock = False
            state.tick()
            if state.stop_status == "interrupted":
                signal_name = state.summary.get("interrupted_by", "a signal")
                checkpointed = self.checkpointer.interval.enabled
                state.stop_reason = interrupted_reason(signal_name, state.timestamp.batch, checkpointed)
            self.services.divergence.finish(state)
            self._hooks.fit_end(state=state)
        except BaseException as error:
            state.shared_clock = False
            state.tick()
            blame(pm, error, (*self.algorithms, *self.callbacks))  # names the plugin, for the summary too
            pm.hook.exception(state=state, error=error)
            raise
        finally:
            restore_signals()
            # The loaders' persistent workers end with the run (the next epoch of another
            # fit() starts new ones): left to the interpreter's exit, they kept an H100
            # run's process alive 40 s after its summary (Python 3.12, data.loaders).
            stop_workers(state.train_loader, state.eval_loader, *state.eval_sets.values())
        self.summary = self.summary_writer.summary
        if self.verbose and state.stop_reason:
            print(f"slipstream: {state.stop_reason}", file=sys.stderr)
        return self.summary

    def _start(self) -> dict[str, Any] | None:
        """Variants, ``init`` and the resume; the summary of a run already at its end,
        which has nothing left to do (None: train)."""
        state, start = self.state, self.start
        # A resumed run keeps the checkpoint's variants; loading weights only is a new
        # run, which measures its own.
        choose_run_variants(state, self.algorithms, self.services, payload=start.payload, options=self.options,
                            verbose=self.verbose)  # fmt: skip
        self.pm.hook.init(state=state)
        check_hooks(self.pm, self.services.defaults)  # init may have registered helpers
        if resume(state, start, options=self.options, config=self.config, hook=self.pm.hook, verbose=self.verbose):
            self.services.losses.load_state_dict(start.payload.get("train_losses"))
            # The records before the checkpoint are in the log of the run that wrote it.
            where = written_in(self.load_path)
            if where is not None:
                resume_summary(state, where.metrics, self.target, self.metrics.higher_is_better)
        if not state.is_done():
            return None
        # Resumed at its end (a requeued job that had finished), or fit() again: nothing
        # is left, unless a signal stopped the run in its last batch, before its end
        # (the final evaluation and summary), which then runs now with the rates of the
        # session that trained.
        finished = self._finished_summary()
        if finished is None:
            # At its end with no summary.json (killed after its last checkpoint): the
            # final evaluation and the summary run now; the training rates are unknown.
            self.summary_writer.carried = dict.fromkeys(("samples_per_s", "mfu"))
            warnings.warn(
                f"slipstream: {self.load_path} is at the run's end, but the run wrote no summary.json "
                "(stopped after its last checkpoint): evaluating and writing it now, with its "
                "throughput unknown",
                stacklevel=3,
            )
            return None
        if self.load_path is not None and finished.get("status") == "interrupted":
            self.summary_writer.carried = finished
            return None
        ts = state.timestamp
        where = self.load_path if self.load_path is not None and ts.batch else "this Trainer"
        if state.rank == 0:
            warnings.warn(
                f"slipstream: {where} is at step {ts.batch} (epoch {ts.epoch}), already at "
                f"trainer.max_duration={state.max_duration}: nothing is left to train, and the "
                "run directory is left as it is; to train on, raise trainer.max_duration (in Python: "
                "a new Trainer with a larger max_duration and load_path=<its checkpoint>)",
                stacklevel=3,
            )
        return finished

    def _finished_summary(self) -> dict[str, Any] | None:
        """The summary of a run already at its end: this Trainer's own after an earlier
        fit(), else the summary.json of the run directory, or of the run that wrote the
        checkpoint; None where neither has one."""
        if self.summary_writer.summary:
            return self.summary_writer.summary
        place: RunDir | None
        for place in filter(None, (self.paths, written_in(self.load_path))):
            try:
                return json.loads(place.summary.read_text())
            except (OSError, ValueError):
                continue
        return None

    def _loop(self) -> None:
        while not self.state.is_done():
            self._run_epoch()

    def _run_epoch(self) -> None:
        state, h, ts = self.state, self._hooks, self.state.timestamp
        self.metrics_log.lr_used = None  # an epoch scheduler's step is now the LR in use
        h.epoch_start(state=state)
        seen_any = False
        for batch in self._epoch_batches():
            seen_any = True
            self._train_batch(batch)
            if state.is_done():
                break
        if not seen_any and ts.batch_in_epoch == 0:
            if ts.epoch > 0:  # it did before: a one-pass iterable
                raise ConfigError(
                    f"the training data yielded no batches in epoch {ts.epoch}, after {ts.batch} "
                    "before it: it can be read only once (an iterator or generator); pass a "
                    "DataLoader (or anything iter() can start again), or give max_duration in batches"
                )
            raise ConfigError(f"the training data yielded no batches; {why_no_batches(self.state.train_loader)}")
        # A run that stops mid-epoch has not completed it (a resume continues there).
        epoch_complete = state.batches_per_epoch is None or ts.batch_in_epoch >= state.batches_per_epoch
        if not state.is_done() or epoch_complete:
            ts.epoch += 1
            ts.batch_in_epoch = 0
            self._step_schedulers(self._epoch_schedulers)
            h.epoch_end(state=state)

    def _train_batch(self, batch: Any) -> None:
        state, h, ts = self.state, self._hooks, self.state.timestamp
        batch = state.batch = self._to_device(batch)
        if type(batch) is not tuple or not batch:  # the mover makes a DataLoader's list a tuple
            check_pair(batch, "training")  # (a tuple of one: compute_loss says it)
        inputs = batch[0]
        samples = (inputs.shape[0] if isinstance(inputs, torch.Tensor) else len(inputs)) * state.world_size
        if h.batch_start:
            h.batch_start(state=state)
        self.normalize.prepare(state)
        if h.before_forward:
            h.before_forward(state=state)
        state.outputs = h.forward(state=state)
        if h.after_forward:
            h.after_forward(state=state)
        state.loss = h.compute_loss(state=state)
        if h.after_loss:
            h.after_loss(state=state)
        if h.before_backward:
            h.before_backward(state=state)
        h.backward(state=state)
        if h.after_backward:
            h.after_backward(state=state)
        if h.should_step(state=state):
            if h.before_optimizer_step:
                h.before_optimizer_step(state=state)
            state.step_skipped = h.optimizer_step(state=state) is False
            state.optimizer.zero_grad(set_to_none=True)
            ts.optimizer_steps += 1
            if self._batch_schedulers:
                self._step_schedulers(self._batch_schedulers)
            if h.after_optimizer_step:
                h.after_optimizer_step(state=state)
        ts.batch += 1
        ts.batch_in_epoch += 1
        ts.samples += samples
        state.tick()
        if self._share_clock is not None:
            self._share_clock(state)
        if h.batch_end:
            h.batch_end(state=state)

    def _step_schedulers(self, schedulers: list[Any]) -> None:
        # Stepped before any hook sees them (a checkpoint saves their state), but the
        # records until the next step log the LR the last one trained with.
        if schedulers:
            self.metrics_log.lr_used = [group["lr"] for group in self.state.optimizer.param_groups]
        for scheduler in schedulers:
            scheduler.step()

    def _epoch_batches(self) -> Iterable[Any]:
        loader, ts = self.state.train_loader, self.state.timestamp
        skip = ts.batch_in_epoch
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            try:
                sampler.set_epoch(ts.epoch, start_batch=skip)
                skip = 0
            except TypeError:  # torch's DistributedSampler: epoch only
                sampler.set_epoch(ts.epoch)
        if skip and isinstance(sampler, torch.utils.data.RandomSampler) and self.state.rank == 0:
            # Its shuffle is drawn afresh, not the interrupted epoch's: skipping its
            # first batches cannot give back the samples that epoch had left.
            warnings.warn(
                f"slipstream: train_data's RandomSampler cannot resume inside an epoch: the rest of "
                f"epoch {ts.epoch} comes from a new shuffle, so some of its samples repeat and others "
                "are left out; for an exact resume use slipstream.data.build_loader (or its "
                "EpochSampler), or resume from a checkpoint at an epoch's end",
                stacklevel=2,
            )
        iterator = iter(loader)
        for _ in range(skip):  # resume mid-epoch on a loader that cannot start late
            next(iterator, None)
        return iterator

    def _checkpoint_payload(self, state: State) -> dict[str, Any]:
        records = self.registry.records([*self.algorithms, *self.callbacks])
        payload = checkpoint_payload(state, records, hook=self.pm.hook)
        return {**payload, "train_losses": self.services.losses.state_dict()}  # the metrics log's open window


def describe_run(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    options: TrainerOptions,
    algorithms: Sequence[Algorithm],
    callbacks: Sequence[Callback],
    metrics: Sequence[Any] | None,
) -> dict[str, Any]:
    """config.yaml for a run set up in Python: what the CLI's config would say, so that
    a checkpoint can tell what wrote it (and `slipstream eval`/`export` rebuild it)."""
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    return {
        "model": _model_record(model),
        # Names and import paths only: a metric object given in Python cannot be written.
        "evaluation": {"metrics": list(metrics) if _named(metrics) else None},
        "optimizer": {"name": type(optimizer).__name__, "lr": float(group.get("lr", 0.0))},
        "trainer": options.as_config(),
        "algorithms": {a.name: config_as_dict(a) for a in algorithms},
        "callbacks": {c.name: config_as_dict(c) for c in callbacks},
    }


def _metrics(
    items: Sequence[Any] | None,
    o: TrainerOptions,
    model: nn.Module,
    loss_fn: Any,
    config: dict[str, Any] | None,
    eval_sets: dict[str, Any],
    device: torch.device,
    callbacks: Sequence[Callback],
) -> Any:
    """The run's metrics (:func:`slipstream.plugins.metric.run_metrics`), checked against
    what reads them before anything is written; ``best_metric`` as the eval records key
    it (``val/accuracy`` of a first set ``val`` is ``accuracy``)."""
    task = data_task(eval_sets)
    o.best_metric = task_best_metric(o.best_metric, task)
    o.target_metric = task_best_metric(o.target_metric, task)
    for callback in callbacks:  # early stopping's default monitor, accuracy, is map in multi-label
        monitored = getattr(callback.config, callback.monitor_option or "", None)
        if isinstance(monitored, str):
            setattr(callback.config, callback.monitor_option, task_best_metric(monitored, task))
    metrics = run_metrics(
        items, loss_fn=loss_fn, num_classes=_classes(model, config), device=device,
        evaluates=o.eval_interval is not None and bool(eval_sets), best_metric=o.best_metric,
        target_accuracy=o.target_accuracy, prefix="trainer." if config is not None else "",
        monitors=_monitors(callbacks), sets=list(eval_sets) or ["val"], task=task,
        target_metric=o.target_metric,
    )  # fmt: skip
    o.best_metric = record_key(o.best_metric, list(eval_sets))
    o.target_metric = record_key(o.target_metric, list(eval_sets)) or o.target_metric
    for callback in callbacks:  # a monitor improves as its metric's plugin says (higher_is_better)
        monitored = getattr(callback.config, callback.monitor_option or "", None)
        if isinstance(monitored, str):
            callback.monitor_higher = metrics.higher_is_better(monitored)
            # As the eval records key it: the first set's metrics are bare (val/accuracy is accuracy).
            setattr(callback.config, callback.monitor_option, record_key(monitored, list(eval_sets)))
    return metrics


def _model_record(model: nn.Module) -> dict[str, Any]:
    """How config.yaml (and so a checkpoint) names a model built in Python: a timm
    model by its architecture, which `slipstream eval` and `export` can build again;
    any other by its class (they then take --model package.module:build)."""
    inner = unwrap_model(model)
    architecture = (getattr(inner, "pretrained_cfg", None) or {}).get("architecture")
    name = f"timm/{architecture}" if isinstance(architecture, str) else type(inner).__name__
    return {"name": name, "num_classes": _classes(model, None)}


def _monitors(callbacks: Sequence[Callback]) -> dict[str, str | None]:
    """The eval metric each callback that watches one monitors (early stopping's), by option."""
    out = {}
    for callback in callbacks:
        option = getattr(callback, "monitor_option", None)
        if option is not None:
            out[f"callbacks.{callback.name}.{option}"] = getattr(callback.config, option, None)
    return out


def _named(metrics: Sequence[Any] | None) -> bool:
    return metrics is not None and all(isinstance(m, (str, dict)) for m in metrics)


def _classes(model: nn.Module, config: dict[str, Any] | None) -> int | None:
    """The classes the model predicts where known before its first evaluation: the
    config's, or a timm model's ``num_classes``; None: found at the first evaluation."""
    classes = ((config or {}).get("model") or {}).get("num_classes")
    if classes is None:
        classes = getattr(unwrap_model(model), "num_classes", None)
    return classes if isinstance(classes, int) and not isinstance(classes, bool) and classes > 1 else None


def _options(
    options: TrainerOptions | None, settings: dict[str, Any], *, max_duration: Any, run_dir: Any
) -> TrainerOptions:
    """The run-level settings, given as keywords (validated here) or, by the command
    line, as options its config validated; max_duration=None keeps the default."""
    if max_duration is not None:
        settings["max_duration"] = max_duration
    if run_dir is not None:
        settings["run_dir"] = run_dir
    if options is None:
        return TrainerOptions.from_keywords(settings).validate()
    if settings:
        raise ConfigError(
            f"Trainer: give the settings as options= or as keywords, not both (got options= and {', '.join(settings)})"
        )
    return options if options.validated else options.validate()


def _signature() -> inspect.Signature:
    """The Trainer's signature as ``help()`` and ``inspect`` show it: the settings it
    takes as ``**settings`` spelled out from TrainerOptions, with their defaults."""
    signature = inspect.signature(Trainer.__init__)
    defaults = {f.name: f for f in dataclasses.fields(TrainerOptions)}
    params = []
    for param in signature.parameters.values():
        if param.kind is param.VAR_KEYWORD:
            params += [
                inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
                for name, f in defaults.items()
                if name not in signature.parameters
            ]
        elif param.name in defaults:
            params.append(param.replace(default=defaults[param.name].default))
        else:
            params.append(param)
    return signature.replace(parameters=params)


Trainer.__init__.__signature__ = _signature()  # type: ignore[attr-defined]
