"""The plugins of a run: each entry-point group discovered once, the chosen plugins
built, ordered and checked once.

A :class:`Registry` is made once per command (``slipstream train`` hands its own to
the config, the data and the Trainer) or by a Trainer made in Python. Discovery reads
metadata only; a plugin is imported when a run uses it (:mod:`slipstream.plugins.discovery`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from slipstream.errors import PluginError
from slipstream.plugins.algorithm import Algorithm
from slipstream.plugins.base import Plugin
from slipstream.plugins.callback import Callback
from slipstream.plugins.discovery import (
    ALGORITHMS_GROUP,
    CALLBACKS_GROUP,
    GROUPS,
    PluginInfo,
    algorithm_record,
    check_callbacks,
    discover,
    distribution_of,
    instantiate,
    resolve_order,
)


class Registry:
    """The installed plugins, by entry-point group, each group discovered when first
    asked for (``installed``: the algorithms already discovered by the caller)."""

    def __init__(self, installed: dict[str, PluginInfo] | None = None) -> None:
        self._groups: dict[str, dict[str, PluginInfo]] = {}
        self._distributions: dict[int, tuple[str, str]] = {}  # by plugin: asked at every checkpoint
        if installed is not None:
            self._groups[ALGORITHMS_GROUP] = installed

    def installed(self, group: str = ALGORITHMS_GROUP) -> dict[str, PluginInfo]:
        """The installed plugins of ``group``, by name (discovered, not imported)."""
        if group not in self._groups:
            self._groups[group] = discover(load=False, group=group)
        return self._groups[group]

    def build(self, options: Mapping[str, Any], group: str = ALGORITHMS_GROUP) -> list[Any]:
        """The plugins a config section names (name to options), built and checked: an
        unknown name or option is a ConfigError naming it."""
        return instantiate(dict(options), self.installed(group), group)

    def plugins(self, items: Sequence[Any] | str | None, group: str) -> list[Any]:
        """A Trainer's ``algorithms=`` or ``callbacks=``: instances as given, names
        (or one ``"a,b"`` string, as on the command line) built with their defaults."""
        base, noun = GROUPS[group]
        if items is None:
            return []
        if isinstance(items, str):
            items = [name.strip() for name in items.split(",") if name.strip()]
        built: list[Any] = []
        for item in items:
            if isinstance(item, base):
                built.append(item)
            elif isinstance(item, str):
                built.extend(self.build({item: None}, group))
            elif isinstance(item, type) and issubclass(item, base):
                raise PluginError(f"{item.__name__} is a class; pass an instance: {item.__name__}()")
            else:
                article = "an" if base.__name__[0] in "AEIOU" else "a"
                raise PluginError(f"{item!r} is not {article} {base.__name__} instance or an installed {noun}'s name")
        return built

    def run_plugins(
        self, algorithms: Sequence[Any] | str | None, callbacks: Sequence[Any] | str | None
    ) -> tuple[list[Algorithm], list[Callback]]:
        """A run's algorithms, in their one order, and its callbacks, checked together."""
        chosen = self.plugins(algorithms, ALGORITHMS_GROUP)
        ordered = resolve_order(chosen, installed=self._order_names(chosen))
        observers = self.plugins(callbacks, CALLBACKS_GROUP)
        check_callbacks(observers, ordered)
        return ordered, observers

    def _order_names(self, algorithms: list[Algorithm]) -> set[str]:
        """Names an order declaration may use: the run's and the installed ones
        (discovered only when a declaration names an algorithm outside the run)."""
        names = {a.name for a in algorithms}
        declared = {n for a in algorithms for n in (*a.runs_after, *a.runs_before)}
        if declared <= names:
            return names
        return names | set(self.installed(ALGORITHMS_GROUP))

    def records(self, plugins: Sequence[Plugin]) -> list[dict[str, Any]]:
        """How checkpoints and summary.json name each plugin: name, version,
        distribution and config."""
        return [algorithm_record(p, self._distribution(p)) for p in plugins]

    def _distribution(self, plugin: Plugin) -> tuple[str, str]:
        if id(plugin) not in self._distributions:
            group = CALLBACKS_GROUP if isinstance(plugin, Callback) else ALGORITHMS_GROUP
            self._distributions[id(plugin)] = distribution_of(plugin, self._groups.get(group))
        return self._distributions[id(plugin)]

    def run_files(self, plugins: Sequence[Plugin], *, every_callback: bool) -> set[str]:
        """What plugins write under the run directory: ``plugins``', and with
        ``every_callback`` every installed callback's (a logger of a previous run whose
        folder would otherwise mix two runs; importing them costs ~10 ms)."""
        names = {n for p in plugins for n in p.run_files}
        if every_callback:
            for info in self.installed(CALLBACKS_GROUP).values():
                info.load()
                names.update(getattr(info.cls, "run_files", ()))
        return names
