"""`Algorithm`, the base class of every speed-up technique."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from slipstream.plugins.base import Plugin

if TYPE_CHECKING:
    from slipstream.plugins.variants import Variant
    from slipstream.state import State


class Algorithm(Plugin):
    """A speed-up technique: a name, an optional config dataclass and hook methods.

    Subclasses set ``name`` (what users type after ``--algorithms``) and may set
    ``config_class`` (a dataclass whose ``__post_init__`` raises ``ValueError`` for
    an out-of-range value). The engine builds the algorithm as ``cls(config)``.

    Order is declared, never accidental: ``runs_after`` and ``runs_before`` name
    algorithms whose hooks must fire before (after) this one's; ``conflicts_with``
    names algorithms that cannot share a run, as a tuple or as a dict from each name
    to why (the refusal at start-up quotes it). Names of algorithms that are not in
    the run are ignored.

    Hooks are plain methods decorated with :data:`slipstream.hookimpl`. State that
    must survive a checkpoint goes through ``state_dict`` / ``load_state_dict``.

    Measured ``auto`` (:mod:`slipstream.plugins.variants`): an algorithm whose setting leaves
    a choice the run's own step should decide (bf16 or fp32, NHWC or NCHW, a fused
    kernel or not) returns its options from :meth:`variants`; the engine times them on
    copies at fit start and calls :meth:`use_variant` with the winner before ``init``.
    """

    kind: ClassVar[str] = "algorithm"
    runs_after: ClassVar[tuple[str, ...]] = ()
    runs_before: ClassVar[tuple[str, ...]] = ()
    conflicts_with: ClassVar[tuple[str, ...] | dict[str, str]] = ()

    # The variant the engine chose for this run (None: nothing was chosen, e.g. the
    # plugin runs outside a Trainer; :meth:`variants`' first is then the fallback).
    variant: str | None = None

    def variants(self, state: State) -> Sequence[Variant | str]:
        """The variants this algorithm can run in on this run (``state`` has the
        device, model and optimizer; ``init`` has not run), the first its fallback
        where nothing is measured. Empty (the default) or one variant: nothing to
        choose, as where an explicit setting fixes it. A :class:`~slipstream.plugins.variants.Variant`
        with a ``margin`` is taken only where it is that much faster."""
        del state
        return ()

    def use_variant(self, name: str) -> None:
        """Told by the engine before ``init``: run as variant ``name`` (one of
        :meth:`variants`' names). Stored in :attr:`variant`; override to do more."""
        self.variant = name
