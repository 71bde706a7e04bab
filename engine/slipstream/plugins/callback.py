"""`Callback`, the base class of every plugin that observes a run."""

from __future__ import annotations

from typing import ClassVar, Optional

from slipstream.plugins.base import Plugin


class Callback(Plugin):
    """An observer of the run: a logger, a profiler, a monitor, early stopping.

    The same hooks and config mechanism as an :class:`~slipstream.Algorithm`
    (``name``, optional ``config_class``, built as ``cls(config)``, hook methods
    decorated with :data:`slipstream.hookimpl`, ``state_dict`` /
    ``load_state_dict``), enabled with ``--callbacks`` or a recipe's
    ``callbacks:`` section and registered through the ``slipstream.callbacks``
    entry-point group.

    A callback observes: it may read ``state`` and ask the run to stop
    (``state.request_stop(status, reason)``), but it may not implement a step hook
    (``forward``, ``compute_loss``, ``backward``, ``should_step``,
    ``optimizer_step``); the run refuses to start if it does. At every event,
    callbacks are called after the algorithms and after the engine's services, so
    they see the record written, the checkpoint saved and, at ``fit_end``,
    ``summary.json`` written. ``log_metrics(state, record)`` gives each record of
    ``metrics.jsonl`` as it is written (global rank 0 only).
    """

    kind: ClassVar[str] = "callback"
    # A callback that acts on evaluations (early stopping): a run without any is told
    # that it never acts.
    needs_evaluation: ClassVar[bool] = False
    # Its option that names the metric it watches (early stopping's ``monitor``): a
    # metric the run cannot have (accuracy_top5 with fewer than 5 classes) is warned about.
    monitor_option: ClassVar[Optional[str]] = None
    # Whether that metric is better higher: set by the engine before the run from the
    # metric plugin's ``higher_is_better`` (None: not known, outside a Trainer).
    monitor_higher: Optional[bool] = None
