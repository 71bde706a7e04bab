"""The hook contract between the engine and its plugins.

This module is the reference for plugin authors. Every hook receives the one
mutable :class:`slipstream.State`; a plugin implements a hook by defining a method
of the same name decorated with :data:`slipstream.hookimpl`. A method marked as a
hook whose name is not one of the hooks below (a typo such as ``batch_stat``) is
refused when the run starts, with the plugin, the method and the closest hook name;
this is checked after registration and again after ``init``, which may register
helper plugins.

There are three kinds of hook.

**Events** are notifications. A plugin mutates ``state`` (swap the batch, change
the model, record a metric); return values are ignored. Within one training batch
they fire in the order they are listed below.

**Steps** do the work of the loop. Each is ``firstresult``: the first
implementation that returns something other than ``None`` wins. The engine supplies
the default of every step as a ``trylast`` implementation of its own, so a plugin
can either

* *wrap* a step with ``@hookimpl(wrapper=True)`` and a ``yield`` (autocast around
  ``forward``, divide the loss returned by ``compute_loss``, ``no_sync`` around
  ``backward``). Wrappers compose: any number of plugins may wrap the same step; or
* *replace* it with a plain implementation that returns a value (a GradScaler's
  ``scale(loss).backward()``). Two plugins replacing the same step is an error at
  start-up that names both, because only one of them could ever run. A replacing
  implementation that leaves the step to the engine in some runs (no GradScaler
  under bf16) returns :data:`NOT_MINE`; one that returns ``None`` is an error naming
  the plugin, since to pluggy ``None`` means "go on", and a forgotten ``return``
  would run the step a second time in the engine's default.

**Persistence** is not a hook: any plugin instance may define ``state_dict()`` and
``load_state_dict(state_dict)``; checkpoints store the result under the plugin's
registered name, with its distribution's version and its config. When a run
resumes, ``load_state_dict`` is called once, *after* ``init`` and before
``fit_start``: whatever ``init`` builds (an EMA copy, a GradScaler) exists when the
saved state arrives. A plugin never sees ``load_state_dict`` before ``init``.

Call order
----------
The order is pluggy's, for every hook alike:

1. Wrappers (``wrapper=True``) run around everything else: the code before their
   ``yield`` first, the code after it last. Among wrappers, ``tryfirst`` ones are
   outermost, then plain ones, then ``trylast`` ones.
2. Then the implementations that are not wrappers, in three tiers: ``tryfirst``,
   then plain, then ``trylast``.
3. Within the ``tryfirst`` and the plain tier, the plugin registered *last* is
   called *first*. (pluggy inserts ``trylast`` implementations at the front of
   the list, so within the ``trylast`` tier the plugin registered *first* is
   called first.)

The engine registers the run's callbacks first, then its own services, then the
run's algorithms, the first algorithm of the resolved order (``runs_after``/
``runs_before``, then the order given) last (``Trainer._register``; a test checks
this list against it). So at every event, plain implementations run as:

    algorithms, in the resolved order
    -> engine.evaluation (evaluates at batch_end/epoch_end when an interval is due)
    -> engine.target (only with trainer.target_accuracy: time to target, the stop)
    -> engine.utilization (FLOPs per batch for MFU; peak memory from fit_start)
    -> engine.metrics (writes the train/eval record to metrics.jsonl)
    -> engine.progress (the progress bar, rank 0 only, when it is on)
    -> engine.losses (keeps each batch's loss at after_loss; the metrics record and
       every checkpoint read them, and the divergence check looks at each value read)
    -> engine.checkpoint (saves at batch_end/epoch_end when due, and at fit_end)
    -> engine.summary (writes summary.json at fit_end and on exception)
    -> engine.steps (the default of every step; steps only)
    -> callbacks, in the order given (``--callbacks``, a recipe's ``callbacks:``)

so a checkpoint or a metrics record always holds what every algorithm did at that
event, and a callback (which observes) sees what the engine recorded: the eval
record written and ``checkpoints/best.pt`` saved at ``eval_end``, ``summary.json``
at ``fit_end``. A callback may not implement a step hook.

Exceptions to this order are marked (``tryfirst`` and ``trylast`` tiers come before
and after every plain implementation, callbacks' included):

* ``engine.evaluation``'s ``fit_end`` is ``tryfirst``: every ``fit_end`` sees the
  final evaluation;
* ``engine.target``'s ``eval_end`` is ``trylast``: it reuses the eval record's
  ``elapsed_s``, so it runs after the callbacks' ``eval_end`` too, and a callback
  sees ``time_to_target_s`` only from the next event on;
* ``engine.progress``'s ``fit_end`` is ``trylast``: the bar closes last;
* ``engine.steps`` provides every step as ``trylast`` (the default a plugin
  replaces or wraps).

An algorithm that must act after the engine's services (restore a global setting
after the last checkpoint) uses ``trylast``.

``*_end`` events run in the same order as ``*_start`` events, not reversed. One
rule for every event keeps ``tryfirst``/``trylast`` meaning the same everywhere and
lets the engine's services record after every algorithm at the end of a batch or
an evaluation too. A plugin that must undo something after the others have
finished (restore weights it swapped in at ``eval_start``) makes its ``*_end``
``trylast``; set-up and tear-down that must nest belong in a step wrapper.

Where the batch is, and what it holds
-------------------------------------
``state.batch`` is ``(inputs, targets)`` for classification (a loader may add items
after them, which plugins pass on as ``*rest``), always a tuple, already on the run's
device, at every batch event. A loader's dict batch is made that tuple where it
enters the loop, by one mapping (``slipstream.services.batches.as_pair``: inputs
under ``image``/``images``/``pixel_values``/``inputs``/``input``, targets under
``label``/``labels``/``targets``/``target``, any other keys as a dict third), so no
plugin sees a dict. Normalisation is not a hook implementation: it is an
explicit step of the loop that runs after ``batch_start`` (and after
``eval_batch_start`` at evaluation) has returned, so it comes after every plugin's
batch transform, ``trylast`` ones included.

At ``batch_start`` and ``eval_batch_start`` the inputs are as the loader yielded
them, moved to the device: for the built-in datasets (synthetic, CIFAR,
ImageFolder) ``uint8`` in 0-255, ``(N, C, H, W)``, contiguous NCHW (a quarter of the
bytes of float32 through collate and transfer; pinned and copied ``non_blocking`` on
CUDA). A user's loader may yield float in [0, 1] instead. A plugin earlier in the
order may already have replaced them (a resize keeps ``uint8`` on CPU; an
augmentation returns float in [0, 1]). A plugin that computes on pixel values calls
:func:`slipstream.to_unit_float`, which turns either into float in [0, 1] (a copy
for ``uint8``, nothing for float); one that only moves pixels (crop, flip) may keep
the dtype. Never normalise here: the engine does.

The targets are class indices (``int64``, ``(N,)``) as the loader yielded them, or,
for a multi-label dataset (``DatasetPlugin.task == "multilabel"``, e.g.
``synthetic_multilabel``), multi-hot vectors, float32 ``(N, num_classes)`` of 0 and 1.
A mixing plugin (``mixup``, ``cutmix``) replaces them at ``batch_start`` with float
``(N, num_classes)`` mixtures: class probabilities whose rows sum to 1 from class
indices, which torch's cross-entropy (the default loss) takes as they are, or mixed
multi-hot rows, which ``loss.name=bce`` takes. Evaluation targets are never mixed:
class indices, or the multi-hot vectors of a multi-label dataset.

From ``before_forward`` on, and at ``eval_batch_end``, the inputs are what the model
receives: float32, normalised with the dataset's mean and std (``data.normalize``;
without it, in [0, 1]; a float batch without normalisation is left as it is), in
``state.input_memory_format`` (contiguous NCHW by default; channels-last when a
plugin such as ``channels_last`` sets it at ``init``). Only 4-D inputs are converted.

    for each training batch:
        state.batch = batch moved to the device
        batch_start                        (batch transforms; uint8 or float [0, 1])
        engine: float32, normalised, in state.input_memory_format (always last)
        before_forward
        state.outputs = forward            (step)
        after_forward
        state.loss = compute_loss          (step, training only)
        after_loss
        before_backward; backward (step); after_backward
        if should_step (step):
            before_optimizer_step; optimizer_step (step); zero_grad
            after_optimizer_step
        advance state.timestamp
        batch_end                          (evaluation and checkpoints when due)

Parallelism: wrapping, saving and loading
-----------------------------------------
Three more steps let a parallelism plugin (FSDP, say) own how the model is
distributed and how its state is saved and loaded, so that the engine names none:

* ``wrap_model`` runs once after ``init`` and after a resume has loaded the
  checkpoint, before ``fit_start``; it returns the module to train. The engine's
  default wraps the model in ``DistributedDataParallel`` when several processes
  run, and returns it as it is otherwise. A plugin that distributes the model itself
  returns ``state.model`` unchanged (it is already sharded).
* ``state_dicts`` returns ``{"model": ..., "optimizer": ...}`` for a checkpoint.
  It runs on every rank (it may hold collectives); rank 0 writes the result. The
  default returns the unwrapped model's and the optimizer's own ``state_dict()``.
  Tensors that are ``DTensor`` shards are written with ``torch.distributed.checkpoint``
  by every rank into a folder beside the checkpoint file; anything else goes into
  the file.
* ``load_state_dicts(state, state_dicts)`` loads what ``state_dicts`` returned
  (read back from the file, or from the shard folder into the dicts that
  ``state_dicts`` returns now). It runs after ``init``; the default loads the
  unwrapped model and the optimizer. A mismatch raises ``RuntimeError`` (model) or
  ``ValueError``/``KeyError`` (optimizer), which the engine reports as a checkpoint
  that does not fit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from slipstream.state import State

PROJECT = "slipstream"

hookspec = pluggy.HookspecMarker(PROJECT)


class _NotMine:
    """The type of :data:`NOT_MINE`."""

    _instance: _NotMine | None = None

    def __new__(cls) -> _NotMine:  # one instance, also after copy or pickling
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __reduce__(self) -> str:
        return "NOT_MINE"

    def __repr__(self) -> str:
        return "slipstream.NOT_MINE"


# What a step implementation that replaces the engine's returns to leave this call
# of the step to the implementations after it (in the end the engine's default).
NOT_MINE = _NotMine()
hookimpl = pluggy.HookimplMarker(PROJECT)

# Names of the step hooks: those of the loop, in the order it calls them, then
# those of set-up and checkpoints (see "Parallelism" below).
STEPS = (
    "forward",
    "compute_loss",
    "backward",
    "should_step",
    "optimizer_step",
    "wrap_model",
    "state_dicts",
    "load_state_dicts",
)

# Names of the events in the order the loop fires them (see Trainer.fit);
# log_metrics comes last: the metrics log fires it when it writes records (inside
# batch_end, eval_end, a checkpoint's save, fit_end or exception).
EVENTS = (
    "init",
    "fit_start",
    "epoch_start",
    "batch_start",
    "before_forward",
    "after_forward",
    "after_loss",
    "before_backward",
    "after_backward",
    "before_optimizer_step",
    "after_optimizer_step",
    "batch_end",
    "epoch_end",
    "eval_start",
    "eval_batch_start",
    "eval_batch_end",
    "eval_end",
    "fit_end",
    "exception",
    "log_metrics",
)

# The events fired for every training batch. The loop skips one nobody implements
# (`Trainer.hooks` holds None for it), so an unused event costs a run nothing.
BATCH_EVENTS = EVENTS[EVENTS.index("batch_start") : EVENTS.index("batch_end") + 1]


# ---------------------------------------------------------------------------
# Events
# ---------------------------------------------------------------------------


@hookspec
def init(state: State) -> None:
    """The model and optimizer exist; nothing is wrapped for distribution yet.

    Model surgery goes here (convert layers, change memory format, add
    parameters). A plugin that adds parameters must add them to
    ``state.optimizer`` too (``optimizer.add_param_group``) or rebuild it.
    No batch exists yet.
    """


@hookspec
def fit_start(state: State) -> None:
    """Once, after ``init`` and after distributed wrapping, before the first epoch.

    The model is in training mode here (the engine calls ``train()`` on it just
    before): a plugin that keeps part of it in eval mode sets that here.
    ``state.timestamp`` may already be past zero when the run resumes from a
    checkpoint.
    """


@hookspec
def epoch_start(state: State) -> None:
    """At the start of each epoch, before its first batch is loaded."""


@hookspec
def batch_start(state: State) -> None:
    """A training batch has been loaded and moved to the device.

    Batch transforms go here: resize, augment. Inputs are as the data loader
    yielded them (``uint8`` NCHW for the built-in datasets, float in [0, 1] from a
    float loader) or as an earlier plugin left them, and not yet normalised: the
    engine converts them to float32, normalises them and sets their memory format
    after this event has returned, after every implementation of it, ``trylast``
    ones included. Call :func:`slipstream.to_unit_float` before computing on pixels.
    """


@hookspec
def before_forward(state: State) -> None:
    """The batch is final: float32, normalised, in ``state.input_memory_format``;
    ``state.outputs`` is about to be computed."""


@hookspec
def after_forward(state: State) -> None:
    """``state.outputs`` holds the model's outputs for ``state.batch``."""


@hookspec
def after_loss(state: State) -> None:
    """``state.loss`` holds the loss that backward will use."""


@hookspec
def before_backward(state: State) -> None:
    """Just before the backward pass."""


@hookspec
def after_backward(state: State) -> None:
    """Gradients of this batch have been accumulated into ``.grad``.

    Under mixed precision with loss scaling, gradients may still be scaled here.
    """


@hookspec
def before_optimizer_step(state: State) -> None:
    """The optimizer is about to step: gradients are final and unscaled.

    Fired only on batches where ``should_step`` said yes. Gradient clipping goes
    here.
    """


@hookspec
def after_optimizer_step(state: State) -> None:
    """The optimizer has stepped (or skipped a step on inf/NaN gradients, which
    ``state.step_skipped`` records) and gradients have been zeroed. Per-step
    schedules go here; ``state.timestamp.optimizer_steps`` has been advanced."""


@hookspec
def batch_end(state: State) -> None:
    """The batch is finished and ``state.timestamp`` has been advanced past it."""


@hookspec
def epoch_end(state: State) -> None:
    """The epoch is finished and ``state.timestamp.epoch`` has been advanced."""


@hookspec
def eval_start(state: State) -> None:
    """Evaluation is about to run; the model is in eval mode (swap weights here)."""


@hookspec
def eval_batch_start(state: State) -> None:
    """An evaluation batch is on the device in ``state.batch``, as the loader
    yielded it (``uint8`` for the built-in datasets) and not yet normalised: the
    engine converts and normalises it after this event, as at training.
    Transforms that must also apply at evaluation go here; training-only
    transforms (augmentation, resizing) must not."""


@hookspec
def eval_batch_end(state: State) -> None:
    """``state.outputs`` holds the outputs for the evaluation batch, whose inputs
    are as the model received them (float32, normalised)."""


@hookspec
def eval_end(state: State) -> None:
    """Evaluation is done: ``state.eval_metrics`` holds the run's metrics
    (``evaluation.metrics``; by default ``loss``, ``accuracy`` and, when the model has
    at least 5 classes, ``accuracy_top5``), reduced across ranks.
    The model is still in eval mode (restore swapped weights here)."""


@hookspec
def fit_end(state: State) -> None:
    """The run has finished (its duration is reached, or it was stopped)."""


@hookspec
def exception(state: State, error: BaseException) -> None:
    """The run failed with ``error``; the engine re-raises it after this event."""


@hookspec
def log_metrics(state: State, record: dict[str, Any]) -> None:
    """A record has just been appended to ``metrics.jsonl``: ``record`` is that
    line, parsed (strict JSON: a non-finite value is None and named in
    ``record["nonfinite"]``). Train records (``record["kind"] == "train"``) are made
    at every logging interval and at the end; eval records (``"eval"``, with
    ``loss`` and ``accuracy``) after every evaluation. Records are written, and
    this hook fired for each in order, together: at most a second after they were
    made, and before an eval record, a checkpoint, the end of the run or its
    failure. So ``state`` is the run as it stands at the write, which may be some
    batches past the record: ``record["step"]`` (the global batch) says which step
    it describes. Fired on global rank 0 only (the one that writes), so every logger
    sees exactly what ``metrics.jsonl`` gets. Do not change ``record``: it is shared
    by every implementation."""


# ---------------------------------------------------------------------------
# Steps (firstresult; the engine's defaults are trylast)
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def forward(state: State) -> Any:
    """Return the model's outputs for ``state.batch``. Also used at evaluation
    (``state.training`` is False there), so autocast wrappers speed up both."""


@hookspec(firstresult=True)
def compute_loss(state: State) -> Any:
    """Return the loss (a scalar tensor) from ``state.outputs`` and ``state.batch``.

    Training only: evaluation computes plain cross-entropy (and top-1 accuracy)
    from the logits itself, so label smoothing or a replaced loss changes the
    training loss and never the reported evaluation loss."""


@hookspec(firstresult=True)
def backward(state: State) -> Any:
    """Run the backward pass of ``state.loss``; return ``True`` when done."""


@hookspec(firstresult=True)
def should_step(state: State) -> Any:
    """Return whether the optimizer steps after this batch (``True`` by default;
    gradient accumulation returns ``False`` on all but every N-th batch)."""


@hookspec(firstresult=True)
def optimizer_step(state: State) -> Any:
    """Step the optimizer; return ``True`` if it stepped and ``False`` if the step
    was skipped (for example for inf/NaN gradients)."""


@hookspec(firstresult=True)
def wrap_model(state: State) -> Any:
    """Return the module to train, distributed as the run needs (``DistributedDataParallel``
    by default when several processes run). Called once, after ``init`` and a resume."""


@hookspec(firstresult=True)
def state_dicts(state: State) -> Any:
    """Return ``{"model": state_dict, "optimizer": state_dict}`` for a checkpoint
    (called on every rank; may run collectives)."""


@hookspec(firstresult=True)
def load_state_dicts(state: State, state_dicts: dict[str, Any]) -> Any:
    """Load ``state_dicts`` (``{"model": ..., "optimizer": ...}``) into the model and the
    optimizer; return ``True`` when done."""
