"""`Algorithm`, the base class of every speed-up technique."""

from __future__ import annotations

from typing import ClassVar

from .plugin import Plugin


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
    """

    kind: ClassVar[str] = "algorithm"
    runs_after: ClassVar[tuple[str, ...]] = ()
    runs_before: ClassVar[tuple[str, ...]] = ()
    conflicts_with: ClassVar[tuple[str, ...] | dict[str, str]] = ()
