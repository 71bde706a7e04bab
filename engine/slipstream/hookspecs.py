"""The hook contract between the engine and its plugins.

This module is the reference for plugin authors. Every hook receives the one
mutable :class:`slipstream.State`; a plugin implements a hook by defining a method
of the same name decorated with :data:`slipstream.hookimpl`.

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
  start-up that names both, because only one of them could ever run.

**Persistence** is not a hook: any plugin instance may define ``state_dict()`` and
``load_state_dict(state_dict)``; checkpoints store the result under the plugin's
registered name, with its distribution's version and its config.

Where the batch is at each event is written on the event. ``state.batch`` is
``(inputs, targets)`` for classification, already on the run's device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from .state import State

PROJECT = "slipstream"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# Names of the step hooks, in the order the loop calls them.
STEPS = ("forward", "compute_loss", "backward", "should_step", "optimizer_step")

# Names of the events in the order the loop fires them (see Trainer.fit).
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
)


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

    ``state.timestamp`` may already be past zero when the run resumes from a
    checkpoint.
    """


@hookspec
def epoch_start(state: State) -> None:
    """At the start of each epoch, before its first batch is loaded."""


@hookspec
def batch_start(state: State) -> None:
    """A training batch has been loaded and moved to the device.

    Batch transforms go here: resize, augment, change memory format. Inputs are
    float in [0, 1] and not yet normalised (the engine normalises them last, as a
    ``trylast`` implementation of this hook).
    """


@hookspec
def before_forward(state: State) -> None:
    """The batch is final; ``state.outputs`` is about to be computed."""


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
    """An evaluation batch is on the device in ``state.batch`` (inputs in [0, 1]);
    batch transforms that must also apply at evaluation (memory format) go here.
    Training-only transforms (augmentation, resizing) must not."""


@hookspec
def eval_batch_end(state: State) -> None:
    """``state.outputs`` holds the outputs for the evaluation batch."""


@hookspec
def eval_end(state: State) -> None:
    """Evaluation is done: ``state.eval_metrics`` holds ``loss`` and ``accuracy``.
    The model is still in eval mode (restore swapped weights here)."""


@hookspec
def fit_end(state: State) -> None:
    """The run has finished (its duration is reached, or it was stopped)."""


@hookspec
def exception(state: State, error: BaseException) -> None:
    """The run failed with ``error``; the engine re-raises it after this event."""


# ---------------------------------------------------------------------------
# Steps (firstresult; the engine's defaults are trylast)
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def forward(state: State) -> Any:
    """Return the model's outputs for ``state.batch``. Also used at evaluation
    (``state.training`` is False there), so autocast wrappers speed up both."""


@hookspec(firstresult=True)
def compute_loss(state: State) -> Any:
    """Return the loss (a scalar tensor) from ``state.outputs`` and ``state.batch``."""


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
