"""`Trainer`: a plain training loop that fires hooks.

Everything a technique changes happens in a plugin; the loop only moves batches,
calls the step hooks and advances time. The rest of a run lives beside it: what a
checkpoint holds and how a run resumes in :mod:`slipstream.run.checkpoint`, the summary
in :mod:`slipstream.services.summary`, the run directory's policy in
:mod:`slipstream.run.directory`, signals in :mod:`slipstream.interrupts`, and every
"every N" in :mod:`slipstream.interval`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from slipstream import hookspecs
from slipstream.config.options import (
    TrainerOptions,
    apply_process_settings,
    parse_peak_tflops,
    resolve_normalize,
    seed_everything,
)
from slipstream.data.loaders import stop_workers
from slipstream.distributed import init_distributed, resolve_device
from slipstream.duration import Duration
from slipstream.errors import CheckpointError, ConfigError, ConfigWarning, PluginError
from slipstream.interrupts import interrupted_reason, stop_on_signals
from slipstream.optim import check_optimizer_holds
from slipstream.plugins.algorithm import Algorithm
from slipstream.plugins.callback import Callback
from slipstream.plugins.discovery import (
    ALGORITHMS_GROUP,
    CALLBACKS_GROUP,
    GROUPS,
    PluginInfo,
    algorithm_record,
    check_callbacks,
    check_callbacks_observe,
    check_hook_names,
    config_as_dict,
    discover,
    distribution_of,
    instantiate,
    resolve_order,
    unmarked_hooks,
)
from slipstream.plugins.dispatch import bind, bind_event, blame, plugin_manager, step_result_check
from slipstream.plugins.variants import choose_variants, print_choice
from slipstream.run.checkpoint import (
    checkpoint_payload,
    config_differences,
    keep_saved_optimizer_settings,
    load_checkpoint,
    load_weights,
    restore_checkpoint,
    resumed_with_changes,
)
from slipstream.run.directory import RunDir, choose_run_dir, prepare_run_dir
from slipstream.services import (
    Checkpointer,
    DefaultSteps,
    Evaluator,
    MetricsLogger,
    Normalize,
    ProgressBar,
    SummaryWriter,
    TargetAccuracy,
    Utilization,
)
from slipstream.services.batches import batch_mover, check_pair
from slipstream.services.divergence import DivergenceMonitor
from slipstream.services.evaluation import EVALUATION_OFF
from slipstream.services.losses import TrainLosses
from slipstream.services.summary import resume_summary
from slipstream.state import State, unwrap_model


class Trainer:
    """Train ``model`` with ``optimizer`` on ``train_data`` for ``max_duration``.

    ``algorithms`` holds :class:`Algorithm` instances (or installed names, built
    with their default config; one string is read as ``"a,b"`` is on the command
    line); ``callbacks`` the same for :class:`Callback`
    (loggers, profiler, early stopping), called in the order given.
    ``train_data``/``eval_data`` are any iterables of ``(inputs, targets)`` batches,
    usually DataLoaders; a DataLoader whose sampler has ``set_epoch(epoch,
    start_batch)`` (as Slipstream's own) gives an order that depends on the seed and
    epoch alone and resumes mid-epoch exactly.

    The run-level keywords are the fields of
    :class:`~slipstream.config.options.TrainerOptions` (the config's ``trainer``
    section holds the same names and defaults), or ``options=`` one such object; they
    are kept as ``self.options``, validated, then applied as the CLI applies them
    (threads, determinism, seeds), with ``normalize="auto"`` and a ``config.yaml``
    in the run directory. ``eval_interval=None`` means no evaluation and
    ``checkpoint_interval=None`` no checkpoints.

    ``target_accuracy`` (a fraction in (0, 1]) records ``time_to_target_s`` in the
    summary; with ``stop_at_target`` the run ends there with status
    ``target_reached``. ``peak_tflops`` (a number, or a mapping of fp32/bf16/fp16 to
    numbers) is the device's peak for MFU; by default it is probed once per machine.
    ``best_metric`` (``"accuracy"``, ``"loss"`` or None) is the eval metric whose
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
        loss_fn: Callable[..., torch.Tensor] | None = None,
        schedulers: Sequence[Any] = (),
        scheduler_interval: str = "epoch",
        config: dict[str, Any] | None = None,
        installed: dict[str, PluginInfo] | None = None,
        options: TrainerOptions | None = None,
        **settings: Any,
    ) -> None:
        _check_arguments(model, optimizer, train_data, eval_data, loss_fn)
        schedulers = _checked_schedulers(schedulers, optimizer)
        # The run-level settings are TrainerOptions' fields, given as keywords or (the
        # CLI) as options it has already validated and applied; max_duration=None
        # keeps the default.
        if max_duration is not None:
            settings["max_duration"] = max_duration
        if run_dir is not None:
            settings["run_dir"] = run_dir
        if options is None:
            options = TrainerOptions.from_keywords(settings)
        elif settings:
            raise ConfigError(
                f"Trainer: give the settings as options= or as keywords, not both "
                f"(got options= and {', '.join(settings)})"
            )
        self.options = o = options.validate()
        peak = parse_peak_tflops(o.peak_tflops)
        self.device = o.device if isinstance(o.device, torch.device) else resolve_device(o.device)
        apply_process_settings(o, self.device)
        # Training starts from the seed, however much randomness building the model
        # and data drew: a Python run and a CLI run of one seed train alike.
        seed_everything(o.seed)
        rank, world_size = init_distributed(self.device)
        self.max_duration = Duration.parse(o.max_duration)
        self.installed = installed
        chosen = self._as_plugins(algorithms, ALGORITHMS_GROUP)
        self.algorithms = resolve_order(chosen, installed=self._known_names(chosen))
        self.callbacks: list[Callback] = self._as_plugins(callbacks, CALLBACKS_GROUP)
        check_callbacks(self.callbacks, self.algorithms)
        self._distributions = {
            a.name: distribution_of(a, self.installed) for a in self.algorithms
        } | {c.name: distribution_of(c, self._installed_callbacks) for c in self.callbacks}
        self.verbose = o.verbose and rank == 0
        normalize, note = resolve_normalize(o.normalize, train_data)
        if note and self.verbose:
            print(f"slipstream: {note}", file=sys.stderr)
        self.config = config or self._describe_run(model, optimizer)
        self.load_path = Path(o.load_path) if o.load_path else None
        self.weights_only = o.load_weights_only
        overwrite = o.overwrite
        if o.autoresume:
            overwrite = self._autoresume(Path(o.run_dir)) or overwrite
        if self.load_path is not None and not self.load_path.exists():
            # Checked before anything is built or written, so the retry starts clean.
            raise CheckpointError(f"trainer.load_path: checkpoint {self.load_path} does not exist")
        self.overwrite = overwrite
        self.paths = choose_run_dir(
            o.run_dir, overwrite=overwrite, load_path=self._resume_path, weights_from=self.load_path
        )
        self.run_dir = self.paths.root
        self.summary: dict[str, Any] = {}
        self._share_clock: Callable[[State], None] | None = None  # set in fit() (_shared_clock)

        # (The CLI's config says its own, before any Trainer is made.)
        if (eval_data is None or (o.eval_interval is None and config is None)) and rank == 0:
            why = "no eval_data" if eval_data is None else "eval_interval=None"
            evaluated = [f"target_accuracy={o.target_accuracy} is never reached"] if o.target_accuracy else []
            if any(c.name == "early_stopping" for c in self.callbacks):
                evaluated.append("the early_stopping callback never stops the run")
            for what in evaluated:
                warnings.warn(f"slipstream: {what}: {why}, so no evaluation", ConfigWarning, stacklevel=2)
        unoptimized = check_optimizer_holds(model, optimizer)
        if unoptimized and rank == 0:
            warnings.warn(unoptimized, stacklevel=2)
        if isinstance(train_data, Iterator) and self.max_duration.unit == "ep" and self.max_duration.value > 1:
            raise ConfigError(
                f"train_data is a one-pass iterator ({type(train_data).__name__}): it has no second "
                f"epoch, and max_duration={self.max_duration} needs {self.max_duration.value:g}; pass a "
                "DataLoader (or anything iter() can start again), or give max_duration in batches"
            )
        if world_size > 1 and rank == 0 and isinstance(getattr(train_data, "sampler", None), WHOLE_DATASET_SAMPLERS):
            warnings.warn(
                f"slipstream: train_data's sampler is a {type(train_data.sampler).__name__}, so each of "
                f"the {world_size} processes trains on the whole dataset every epoch (the same samples "
                f"{world_size} times over); give it torch's DistributedSampler or "
                "slipstream.data.EpochSampler(rank=, world_size=), or build it with slipstream.data.build_loader",
                stacklevel=2,
            )
        if eval_data is not None and o.eval_interval is not None and _batches_per_epoch(eval_data) == 0:
            raise ConfigError(f"the evaluation data is empty (no batches); give it samples, or {EVALUATION_OFF}")
        if scheduler_interval not in SCHEDULER_INTERVALS:
            raise ConfigError(
                f"Trainer: scheduler_interval must be one of {', '.join(SCHEDULER_INTERVALS)}, "
                f"got {scheduler_interval!r}"
            )
        # Stepped by the loop, not a plugin: the optimizer's LR must have moved before
        # any epoch_end or batch_end hook (a checkpoint) sees the schedulers' state.
        self._epoch_schedulers = list(schedulers) if scheduler_interval == "epoch" else []
        self._batch_schedulers = list(schedulers) if scheduler_interval == "batch" else []
        self.state = State(
            model=model.to(self.device),
            optimizer=optimizer,
            max_duration=self.max_duration,
            train_loader=train_data,
            eval_loader=eval_data,
            device=self.device,
            loss_fn=loss_fn or nn.CrossEntropyLoss(),
            schedulers=list(schedulers),
            seed=o.seed,
            rank=rank,
            world_size=world_size,
            run_dir=self.run_dir,
            config=self.config,
            algorithms=list(self.algorithms),
            callbacks=list(self.callbacks),
        )
        self.state.batches_per_epoch = _batches_per_epoch(train_data)
        single = _single_sample_last_batch(train_data)
        if single and rank == 0:
            warnings.warn(
                f"slipstream: the training data's last batch of each epoch holds 1 sample ({single}); "
                "a model with batch norm cannot train on it: drop it (data.drop_last=true, or "
                "drop_last=True in the DataLoader) or choose another batch size",
                ConfigWarning,
                stacklevel=2,
            )
        if self.state.batches_per_epoch is None:
            _check_unknown_epoch_length(self.max_duration, o, warn=rank == 0)
        batch_size = getattr(train_data, "batch_size", None)
        self.state.global_batch_size = batch_size * world_size if batch_size else None

        self.utilization = Utilization(peak, verbose=self.verbose)
        self.target = (
            TargetAccuracy(o.target_accuracy, o.stop_at_target)
            if o.target_accuracy is not None
            else None
        )
        self.pm = plugin_manager(hookspecs.PROJECT, hookspecs)
        self._register(normalize)
        self._hooks = SimpleNamespace()
        self._to_device = batch_mover(self.device)

    # -- set-up ------------------------------------------------------------------

    @property
    def _resume_path(self) -> Path | None:
        """The checkpoint this run continues (its run directory's files are kept), or
        None for a fresh run, a fine-tuning one included."""
        return None if self.weights_only else self.load_path

    def _autoresume(self, run_dir: Path) -> bool:
        """Continue the run in ``run_dir`` from its latest.pt (in place of load_path),
        refused when its config differs in what changes training. Without one the run
        starts (from load_path when given); returns True when leftovers of an attempt
        that saved no checkpoint are to be cleared."""
        paths = RunDir(run_dir)
        if not paths.latest.is_file():
            ended = paths.ended_as()
            if ended:  # clearing it would lose its results for a run of the same steps again
                raise ConfigError(
                    f"trainer.autoresume: the run in {run_dir} ended ({ended}) and kept no checkpoint "
                    "to continue from; nothing is changed. Choose another trainer.run_dir"
                )
            if self.verbose:
                print(f"slipstream: autoresume: no checkpoint in {run_dir}, starting", file=sys.stderr)
            return bool(paths.holds_run())
        saved = load_checkpoint(paths.latest).get("config")
        differ = config_differences(saved, self.config)
        if differ:
            raise ConfigError(
                f"trainer.autoresume: the run in {run_dir} was started with another config; "
                f"these keys differ: {', '.join(differ)}. Restore them, or choose another "
                "trainer.run_dir"
            )
        self.load_path, self.weights_only = paths.latest, False
        return False

    def _describe_run(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """config.yaml for a run set up in Python: what the CLI's config would say,
        so that a checkpoint can tell what wrote it."""
        group = optimizer.param_groups[0] if optimizer.param_groups else {}
        return {
            "model": {"name": type(unwrap_model(model)).__name__},
            "optimizer": {"name": type(optimizer).__name__, "lr": float(group.get("lr", 0.0))},
            "trainer": self.options.as_config(),
            "algorithms": {a.name: config_as_dict(a) for a in self.algorithms},
            "callbacks": {c.name: config_as_dict(c) for c in self.callbacks},
        }

    _installed_callbacks: dict[str, PluginInfo] | None = None

    def _installed_of(self, group: str) -> dict[str, PluginInfo]:
        """The installed plugins of ``group``, discovered (not imported) once."""
        if group == ALGORITHMS_GROUP:
            if self.installed is None:
                self.installed = discover(load=False)
            return self.installed
        if self._installed_callbacks is None:
            self._installed_callbacks = discover(load=False, group=group)
        return self._installed_callbacks

    def _as_plugins(self, items: Sequence[Any], group: str) -> list[Any]:
        """Instances as given; names built with their default config."""
        base, noun = GROUPS[group]
        if items is None:
            return []
        if isinstance(items, str):  # "ema" or "ema,mixup", as on the command line
            items = [name.strip() for name in items.split(",") if name.strip()]
        built = []
        for item in items:
            if isinstance(item, base):
                built.append(item)
            elif isinstance(item, str):
                built.extend(instantiate({item: None}, self._installed_of(group), group))
            elif isinstance(item, type) and issubclass(item, base):
                raise PluginError(f"{item.__name__} is a class; pass an instance: {item.__name__}()")
            else:
                article = "an" if base.__name__[0] in "AEIOU" else "a"
                raise PluginError(
                    f"{item!r} is not {article} {base.__name__} instance or an installed {noun}'s name"
                )
        return built

    def _plugin_files(self) -> set[str]:
        """What plugins write under the run directory: this run's, and with
        ``overwrite`` every installed callback's (a logger of the previous run whose
        folder would otherwise mix two runs)."""
        names = {n for p in [*self.algorithms, *self.callbacks] for n in p.run_files}
        # Only where there is a previous run to clear: finding the installed callbacks'
        # files imports each of them (~10 ms with five installed).
        if self.overwrite and self.paths.root.is_dir():
            for info in self._installed_of(CALLBACKS_GROUP).values():
                info.load()
                names.update(getattr(info.cls, "run_files", ()))
        return names

    def _known_names(self, algorithms: list[Algorithm]) -> set[str]:
        """Names an order declaration may use: the run's and the installed ones
        (discovered only when a declaration names an algorithm outside the run)."""
        names = {a.name for a in algorithms}
        declared = {n for a in algorithms for n in (*a.runs_after, *a.runs_before)}
        if declared <= names:
            return names
        return names | set(self._installed_of(ALGORITHMS_GROUP))

    def _register(self, normalize: tuple[Sequence[float], Sequence[float]] | None) -> None:
        # pluggy calls the last registered plugin first. Callbacks go in first
        # (the first given last, so it is called first), then services, so that at
        # each event algorithms act, then the engine records, then callbacks observe.
        write = self.state.rank == 0
        for callback in reversed(self.callbacks):
            self.pm.register(callback, name=callback.name)
        self._defaults = DefaultSteps(self.options.ddp)
        self.pm.register(self._defaults, name=DefaultSteps.name)
        self.summary_writer = SummaryWriter(
            self.run_dir,
            self._algorithm_records,
            callback_records=self._callback_records,
            utilization=self.utilization,
            target=self.target,
            write=write,
        )
        self.pm.register(self.summary_writer, name=SummaryWriter.name)
        # The batches' losses, read by the metrics log and before each checkpoint;
        # the divergence monitor looks at every read.
        self.losses = TrainLosses()
        self.divergence = DivergenceMonitor(self.losses, self.options.on_nonfinite)
        self.checkpointer = Checkpointer(
            self.run_dir,
            self._checkpoint_payload,
            self.options.checkpoint_interval,
            self.options.checkpoint_keep,
            write=write,
            guard=self._before_checkpoint,
            best_metric=self.options.best_metric,
        )
        self.pm.register(self.checkpointer, name=Checkpointer.name)
        self.pm.register(self.losses, name=TrainLosses.name)
        self.metrics_log = MetricsLogger(
            self.run_dir,
            self.options.log_interval,
            write=write,
            utilization=self.utilization,
            hooks=self.pm.hook,
            losses=self.losses,
        )
        if self.options.progress_bar and write:  # registered before the metrics log: called after it
            self.pm.register(ProgressBar(metrics=self.metrics_log), name=ProgressBar.name)
        self.pm.register(self.metrics_log, name=MetricsLogger.name)
        # On every rank (not only the writer), so that all ranks' clocks leave out
        # the same counting time and a target stops them all at the same batch.
        self.pm.register(self.utilization, name=Utilization.name)
        if self.target is not None:
            self.target.metrics = self.metrics_log  # the eval record's elapsed_s
            self.pm.register(self.target, name=TargetAccuracy.name)
        # Not a hook implementation: an explicit step after batch_start, so it is
        # last whatever plugins do.
        self.normalize = Normalize(*normalize) if normalize is not None else Normalize()
        self.evaluator = Evaluator(
            self.pm.hook, self.options.eval_interval, self.normalize.prepare, guard=self.divergence.before_evaluation
        )
        self.pm.register(self.evaluator, name=Evaluator.name)
        # The first algorithm in the resolved order is registered last, so its
        # events fire first and its step wrappers are outermost.
        for algo in reversed(self.algorithms):
            self.pm.register(algo, name=algo.name)
        self._check_hooks()
        if write:
            self._warn_unmarked_hooks()

    def _warn_unmarked_hooks(self) -> None:
        for plugin in (*self.algorithms, *self.callbacks):
            for method in unmarked_hooks(self.pm, plugin):
                warnings.warn(
                    f"slipstream: plugin {plugin.name!r} ({type(plugin).__name__}) defines {method!r}, "
                    "the name of a hook, without @hookimpl, so the engine never calls it; mark it "
                    "@hookimpl (from slipstream import hookimpl), or rename it if it is no hook",
                    stacklevel=4,
                )

    def _before_checkpoint(self, state: State) -> bool:
        """The checkpoint service's guard: the metrics log written as far as the
        checkpoint reaches (so a resume from it finds every record before it, the
        run's last one included), then the divergence check, whose False means write
        no checkpoint."""
        self.metrics_log.log_final(state)
        self.metrics_log.flush()
        return self.divergence.check(state)

    def _check_hooks(self) -> None:
        check_hook_names(self.pm)
        check_callbacks_observe(self.pm)
        self._check_step_replacements()

    def _check_step_replacements(self) -> None:
        for step in hookspecs.STEPS:
            impls = [
                impl
                for impl in getattr(self.pm.hook, step).get_hookimpls()
                if not (impl.wrapper or impl.hookwrapper) and impl.plugin is not self._defaults
            ]
            for impl in impls:
                if not getattr(impl.function, "_slipstream_checked", False):
                    impl.function = _checked_step(impl.function, impl.plugin_name, step)
            for impl in getattr(self.pm.hook, step).get_hookimpls():
                if impl.wrapper and not getattr(impl.function, "_slipstream_checked", False):
                    impl.function = _checked_wrapper(impl.function, impl.plugin_name, step)
            replacing = [impl.plugin_name for impl in impls]
            if len(replacing) > 1:
                raise PluginError(
                    f"plugins {replacing[0]!r} and {replacing[1]!r} both replace the '{step}' step, "
                    "so only one of them could run; disable one, or make one wrap the step "
                    "with @hookimpl(wrapper=True)"
                )

    def _bind_hooks(self) -> None:
        """Look every hook up once (`slipstream.plugins.dispatch`): plain implementations are
        called directly; a per-batch event nobody implements is None, and the loop
        skips it."""
        for name in (*hookspecs.EVENTS, *hookspecs.STEPS):
            per_batch = name in hookspecs.BATCH_EVENTS
            setattr(self._hooks, name, bind_event(self.pm, name) if per_batch else bind(self.pm, name))

    @property
    def hooks(self) -> SimpleNamespace:
        """Every hook as the loop calls it, bound when the run starts; the per-batch
        events (`hookspecs.BATCH_EVENTS`) are None when nobody implements them."""
        return self._hooks

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
                names = ", ".join(c.name for c in self.callbacks)
                print(f"slipstream: callbacks: {names}", file=sys.stderr)
            print(f"slipstream: run directory: {self.run_dir}", file=sys.stderr)
        # Told even when quiet: the user must learn that a second signal aborts.
        restore_signals = stop_on_signals(state, verbose=state.rank == 0)
        try:
            # A real resume reads the checkpoint once (it pins the variants); loading
            # weights only is a new run, which measures its own.
            payload = None
            if self.load_path is not None and not self.weights_only:
                payload = load_checkpoint(self.load_path, map_location=state.device)
            self._choose_variants(payload)
            pm.hook.init(state=state)
            self._check_hooks()  # init may have registered helpers
            if self.load_path is not None and self.weights_only:
                load_weights(
                    state.unwrapped_model,
                    self.load_path,
                    ignore_keys=self.options.load_ignore_keys,
                    weights=self.options.load_weights,
                    verbose=self.verbose,
                )
            elif self.load_path is not None:
                restore_checkpoint(
                    state, self.load_path, verbose=self.verbose, hook=self.pm.hook, payload=payload
                )
                self.losses.load_state_dict(payload.get("train_losses"))
                # Changed settings are allowed here (autoresume refused them before the
                # start), but never silent; told once the checkpoint is known to fit.
                saved = payload.get("config")
                changed = config_differences(saved, self.config)
                if changed:
                    state.summary["resumed_with_changes"] = changed
                    if state.rank == 0:
                        warnings.warn(resumed_with_changes(self.load_path, saved, self.config, changed), stacklevel=2)
                    keep_saved_optimizer_settings(self.config, saved, changed)
                # The records before the checkpoint are in the log of the run that wrote it.
                written_in = self._written_in()
                if written_in is not None:
                    resume_summary(state, written_in.metrics, self.target)
            # Resumed at its end (a requeued job that had finished), or fit() again: nothing
            # is left, unless a signal stopped the run in its last batch, before its end
            # (the final evaluation and summary), which then runs now with the rates of
            # the session that trained.
            finished = self._finished_summary() if state.is_done() else None
            if state.is_done() and finished is None:
                # At its end with no summary.json (killed after its last checkpoint): the
                # final evaluation and the summary run now; the training rates are unknown.
                self.summary_writer.carried = dict.fromkeys(("samples_per_s", "mfu"))
                warnings.warn(
                    f"slipstream: {self.load_path} is at the run's end, but the run wrote no summary.json "
                    "(stopped after its last checkpoint): evaluating and writing it now, with its "
                    "throughput unknown",
                    stacklevel=2,
                )
            elif finished is not None and self.load_path is not None and finished.get("status") == "interrupted":
                self.summary_writer.carried = finished
            elif finished is not None:
                ts = state.timestamp
                where = self.load_path if self.load_path is not None and ts.batch else "this Trainer"
                if state.rank == 0:
                    warnings.warn(
                        f"slipstream: {where} is at step {ts.batch} (epoch {ts.epoch}), already at "
                        f"trainer.max_duration={state.max_duration}: nothing is left to train, and the "
                        "run directory is left as it is; to train on, raise trainer.max_duration (in Python: "
                        "a new Trainer with a larger max_duration and load_path=<its checkpoint>)",
                        stacklevel=2,
                    )
                # Nothing runs and nothing is written: another final evaluation and a
                # summary of a session that trained nothing (0 samples/s) would overwrite
                # the finished run's.
                self.summary = finished
                return self.summary
            self._wrap_distributed()
            self._share_clock = self._shared_clock()
            self._bind_hooks()
            if state.rank == 0:
                prepare_run_dir(
                    self.paths,
                    overwrite=self.overwrite,
                    load_path=self._resume_path,
                    config=self.config,
                    verbose=self.verbose,
                    plugin_files=self._plugin_files(),
                )
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
            self.divergence.finish(state)
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
            stop_workers(state.train_loader, state.eval_loader)
        self.summary = self.summary_writer.summary
        if self.verbose and state.stop_reason:
            print(f"slipstream: {state.stop_reason}", file=sys.stderr)
        return self.summary

    def _finished_summary(self) -> dict[str, Any] | None:
        """The summary of a run already at its end: this Trainer's own after an earlier
        fit(), else the summary.json of the run directory, or of the run that wrote the
        checkpoint; None where neither has one."""
        if self.summary_writer.summary:
            return self.summary_writer.summary
        for place in filter(None, (self.paths, self._written_in())):
            try:
                return json.loads(place.summary.read_text())
            except (OSError, ValueError):
                continue
        return None

    def _written_in(self) -> RunDir | None:
        """The run directory of the checkpoint this run loads, when it lies in one."""
        if self.load_path is None or self.load_path.parent.name != "checkpoints":
            return None
        return RunDir(self.load_path.parent.parent)

    def _choose_variants(self, payload: dict[str, Any] | None) -> None:
        """Measured ``auto`` (`slipstream.plugins.variants`): each algorithm that declares
        variants is told which to run before ``init``; a resumed run keeps the
        checkpoint's choice. Every rank runs rank 0's choice."""
        state = self.state
        pinned = None
        if payload is not None:
            pinned = payload.get("variants")
            pinned = dict(pinned) if isinstance(pinned, dict) else {}
        record = choose_variants(
            state,
            self.algorithms,
            model_name=str((self.config.get("model") or {}).get("name", "model")),
            steps=self._defaults,
            prepare=self.normalize.prepare,
            move=self._to_device,
            pinned=pinned,
            measure_on=self.options.autotune,
            warmup=self.options.autotune_warmup,
            timed=self.options.autotune_steps,
            write_cache=state.rank == 0,
        )
        if record is None:
            return
        if state.world_size > 1:
            import torch.distributed as dist

            shared = [record]
            dist.broadcast_object_list(shared, src=0)
            record = shared[0]
            for algo in self.algorithms:
                if algo.name in record["choice"]:
                    algo.use_variant(record["choice"][algo.name])
        state.summary["auto"] = record
        if self.verbose:
            print_choice(record)

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
            raise ConfigError(f"the training data yielded no batches; {_why_no_batches(self.state.train_loader)}")
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

    def _shared_clock(self) -> Callable[[State], None] | None:
        """Across processes, a run that the wall clock ends (or evaluates, or checkpoints)
        must decide by one clock: each rank's own would let one rank stop or evaluate a
        batch before another, which then waits for it in a collective for ever. Each batch
        the ranks agree on the latest of their clocks (one all-reduce of a number; only
        for such runs)."""
        state = self.state
        if state.world_size <= 1 or not self._wall_clock_decides():
            return None
        import torch.distributed as dist

        device = state.device if state.device.type == "cuda" else torch.device("cpu")

        def share(state: State) -> None:
            clock = torch.tensor([state.tick()], dtype=torch.float64, device=device)
            dist.all_reduce(clock, op=dist.ReduceOp.MAX)
            state.timestamp.elapsed_s = float(clock.item())

        # From here until the loop ends, the run decides by the agreed time only (the
        # metrics log's and progress bar's own ticks must not move it on one rank).
        state.shared_clock = True
        return share

    def _wall_clock_decides(self) -> bool:
        if self.state.max_duration.unit == "s":
            return True  # "dur" intervals and schedules then follow the clock too
        for value in (self.options.eval_interval, self.options.checkpoint_interval):
            try:
                if value is not None and Duration.parse(value).unit == "s":
                    return True
            except (ValueError, TypeError):
                continue
        return False

    def _wrap_distributed(self) -> None:
        # DDP by default; a parallelism plugin may distribute the model itself.
        self.state.model = self.pm.hook.wrap_model(state=self.state)

    # -- what checkpoints and the summary record -------------------------------------

    def _algorithm_records(self) -> list[dict[str, Any]]:
        return [algorithm_record(a, self._distributions[a.name]) for a in self.algorithms]

    def _callback_records(self) -> list[dict[str, Any]]:
        return [algorithm_record(c, self._distributions[c.name]) for c in self.callbacks]

    def _checkpoint_payload(self, state: State) -> dict[str, Any]:
        payload = checkpoint_payload(
            state, [*self._algorithm_records(), *self._callback_records()], hook=self.pm.hook
        )
        return {**payload, "train_losses": self.losses.state_dict()}  # the metrics log's open window


SCHEDULER_INTERVALS = ("epoch", "batch")


# A plain DataLoader's samplers: every process that uses one reads all of the dataset.
WHOLE_DATASET_SAMPLERS = (torch.utils.data.RandomSampler, torch.utils.data.SequentialSampler)


def _check_arguments(model: Any, optimizer: Any, train_data: Any, eval_data: Any, loss_fn: Any) -> None:
    """The Trainer's objects are what it takes, or one line says what was given: each
    would otherwise fail later, deep in torch, with a message about something else."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"Trainer: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(optimizer, type):
        raise ConfigError(
            f"Trainer: optimizer must be an optimizer instance, got the class {optimizer.__name__}; "
            f"build it on the model's parameters, e.g. {optimizer.__name__}(model.parameters(), lr=0.1)"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"Trainer: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError(
            f"Trainer: loss_fn must be callable as loss_fn(outputs, targets), got {type(loss_fn).__name__} "
            f"{loss_fn!r}; e.g. torch.nn.CrossEntropyLoss(label_smoothing=0.1), or leave it out for cross-entropy"
        )
    for name, data in (("train_data", train_data), ("eval_data", eval_data)):
        if data is None and name == "eval_data":
            continue
        if isinstance(data, Dataset) and not isinstance(data, IterableDataset):
            raise ConfigError(
                f"Trainer: {name} is a {type(data).__name__}, a dataset of single samples; give batches: "
                "torch.utils.data.DataLoader(dataset, batch_size=...) or slipstream.data.build_loader(...)"
            )
        if not isinstance(data, Iterable):
            raise ConfigError(
                f"Trainer: {name} must be an iterable of (inputs, targets) batches, such as a "
                f"DataLoader; got {type(data).__name__}"
            )


def _check_unknown_epoch_length(max_duration: Duration, options: TrainerOptions, warn: bool) -> None:
    """Without the number of batches in an epoch (train_data has no len()), a time inside
    an epoch cannot be placed: the run's time in epochs moves only at epoch ends."""
    if max_duration.unit == "ep" and not float(max_duration.value).is_integer():
        raise ConfigError(
            f"max_duration={max_duration}: train_data has no len(), so the run cannot tell where "
            f"{max_duration.value:g} epochs end and would train on to the next whole epoch; give "
            "max_duration in whole epochs or in batches (e.g. 500ba)"
        )
    for key in ("eval_interval", "checkpoint_interval"):
        value = getattr(options, key)
        try:
            every = Duration.parse(value) if value is not None else None
        except (ValueError, TypeError):
            continue
        if every is None:
            continue
        epochs = every.value if every.unit == "ep" else None
        if every.unit == "dur" and max_duration.unit == "ep":
            epochs = every.value * max_duration.value
        if epochs is not None and not float(epochs).is_integer() and warn:
            warnings.warn(
                f"slipstream: {key}={value} falls inside an epoch, and train_data has no len(), so the "
                "run cannot tell where: it acts at the first batch_end or epoch_end past the mark instead; "
                "give it in batches (e.g. 100ba) or in whole epochs",
                ConfigWarning,
                stacklevel=3,
            )


def _checked_schedulers(schedulers: Any, optimizer: torch.optim.Optimizer) -> list[Any]:
    """The LR schedulers as a list (one scheduler alone is taken as it is), each on the
    Trainer's optimizer: a scheduler of another optimizer would move nothing the run
    trains with, and the run would end "completed" at its first LR."""
    if schedulers is None:
        return []
    if isinstance(schedulers, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        schedulers = [schedulers]
    if not isinstance(schedulers, Iterable) or isinstance(schedulers, (str, bytes)):
        raise ConfigError(
            f"Trainer: schedulers must be a list of torch LR schedulers, got {type(schedulers).__name__}"
        )
    schedulers = list(schedulers)
    for scheduler in schedulers:
        kind = type(scheduler).__name__
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ConfigError(
                "Trainer: ReduceLROnPlateau steps on a metric, and the loop steps schedulers without one; "
                "use a schedule of time (StepLR, CosineAnnealingLR, OneCycleLR, ...), or step it in your own "
                "algorithm's eval_end hook with state.eval_metrics['loss'] (docs/plugins.md)"
            )
        if not callable(getattr(scheduler, "step", None)):
            raise ConfigError(f"Trainer: schedulers holds a {kind}, which is no LR scheduler (it has no step())")
        if getattr(scheduler, "optimizer", optimizer) is not optimizer:
            raise ConfigError(
                f"Trainer: the {kind} in schedulers was built on another optimizer than the Trainer's, so it "
                "would change nothing the run trains with; build it on the optimizer you pass as optimizer="
            )
    return schedulers


def _checked_step(function: Callable[..., Any], plugin: str, step: str) -> Callable[..., Any]:
    """A replacing step implementation as pluggy and the loop call it: ``NOT_MINE``
    becomes pluggy's None (the next implementation runs), None or a result of a kind the
    step does not allow is an error."""
    allowed = step_result_check(plugin, step)

    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        result = function(*args, **kwargs)
        if result is None:
            raise PluginError(
                f"plugin {plugin!r} replaces the '{step}' step but returned None; return the "
                f"step's result, or slipstream.NOT_MINE to leave the step to the engine"
            )
        if result is hookspecs.NOT_MINE:
            return None
        if allowed is not None:
            allowed(result)
        return result

    checked._slipstream_checked = True  # type: ignore[attr-defined]
    return checked


def _checked_wrapper(function: Callable[..., Any], plugin: str, step: str) -> Callable[..., Any]:
    """A step wrapper (``@hookimpl(wrapper=True)``) as pluggy calls it: what it returns
    is the step's result, so None (a forgotten ``return``) is an error naming it rather
    than a None loss or output failing somewhere after; so is a result of a kind the step
    does not allow."""
    allowed = step_result_check(plugin, step, wraps=True)

    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        result = yield from function(*args, **kwargs)
        if result is None:
            raise PluginError(
                f"plugin {plugin!r} wraps the '{step}' step but returned None; a wrapper returns "
                "the step's result: `result = yield`, then `return result` (or what replaces it)"
            )
        if allowed is not None:
            allowed(result)
        return result

    checked._slipstream_checked = True  # type: ignore[attr-defined]
    return checked


def _single_sample_last_batch(loader: Any) -> str | None:
    """What makes ``loader``'s last batch a single sample, when it keeps it (None else)."""
    batch_size = getattr(loader, "batch_size", None)
    if getattr(loader, "drop_last", True) or not isinstance(batch_size, int) or batch_size < 2:
        return None
    try:
        samples = getattr(loader, "num_samples", None) or len(loader.dataset)
    except (TypeError, AttributeError):
        return None
    if isinstance(samples, int) and samples % batch_size == 1:
        return f"{samples} samples in batches of {batch_size}"
    return None


def _why_no_batches(loader: Any) -> str:
    """What made an epoch of ``loader`` empty, as far as its dataset, batch size and
    sampler tell, and what to change."""
    try:
        samples = len(loader.dataset)
    except (AttributeError, TypeError):  # an iterable without a length
        return "check the dataset and batch size"
    if samples == 0:
        return "its dataset is empty"
    sampler = getattr(loader, "sampler", None)
    batch_size = getattr(loader, "batch_size", None) or getattr(sampler, "batch_size", None)
    world = getattr(sampler, "world_size", 1)
    drops = getattr(sampler, "drop_last", False) or getattr(loader, "drop_last", False)
    if batch_size and drops and samples < batch_size * world:
        per = f"{batch_size} x {world} processes" if world > 1 else str(batch_size)
        return (
            f"its {samples} samples are fewer than one batch of {per}, and drop_last drops that "
            f"partial batch; use a batch size of at most {samples // world or 1}, more samples, or "
            "drop_last=False (data.batch_size, data.train_size, data.drop_last in a config)"
        )
    return f"{samples} samples, batch size {batch_size}; check the dataset's sampler"


def _batches_per_epoch(loader: Any) -> int | None:
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "batches_per_epoch"):
        return int(sampler.batches_per_epoch)
    try:
        return len(loader)
    except TypeError:
        return None


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
