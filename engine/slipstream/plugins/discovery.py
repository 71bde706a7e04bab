"""The plugin host: find algorithms and callbacks through entry points, build them
from config, and resolve the one order a run uses."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import warnings
from collections.abc import Collection, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from slipstream.data.stats import BUILTIN_SUMMARIES
from slipstream.errors import ConfigError, PluginError, did_you_mean, omegaconf_problem
from slipstream.hookspecs import STEPS
from slipstream.plugins.algorithm import Algorithm
from slipstream.plugins.base import Plugin
from slipstream.plugins.callback import Callback
from slipstream.plugins.dataset import DATASETS_GROUP, DatasetPlugin

ALGORITHMS_GROUP = "slipstream.algorithms"
CALLBACKS_GROUP = "slipstream.callbacks"
# Each entry-point group: the base class its plugins subclass, and their noun.
GROUPS: dict[str, tuple[type[Plugin], str]] = {
    ALGORITHMS_GROUP: (Algorithm, "algorithm"),
    CALLBACKS_GROUP: (Callback, "callback"),
    DATASETS_GROUP: (DatasetPlugin, "dataset"),
}


@dataclass
class PluginInfo:
    """One entry point of a plugin group (``slipstream.algorithms`` by default)."""

    name: str
    distribution: str
    version: str
    target: str  # "module:attr", as the entry point declares it
    cls: type[Plugin] | None = None
    error: str | None = None
    entry_point: Any = field(default=None, repr=False, compare=False)
    description: str = ""  # the distribution's one-line Summary (pyproject's description)
    base: type = field(default=Algorithm, repr=False, compare=False)  # what the class must subclass

    def load(self) -> None:
        """Import the entry point once, recording a failure instead of raising it."""
        if self.entry_point is None:
            return
        ep, self.entry_point = self.entry_point, None
        try:
            cls = ep.load()
        except SystemExit as exc:  # sys.exit() at import must not end the host
            self.error = f"its import called sys.exit({exc.code!r})"
            return
        except Exception as exc:  # a plugin's import may fail in any way
            self.error = f"{type(exc).__name__}: {exc}"
            return
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            self.error = f"{ep.value} is not a subclass of slipstream.{self.base.__name__}"
        elif cls.name != ep.name:
            self.error = f"{ep.value} is named {cls.name!r} but registered as {ep.name!r}"
        else:
            self.cls = cls

    def check_module(self) -> None:
        """Record an error if the entry point's module cannot be found, without
        importing it (a cheap check: an import that fails inside the module needs
        :meth:`load`)."""
        module = self.target.split(":")[0].strip()
        if self.error is not None or not module:
            return
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError) as exc:  # a dotted name whose parent fails
            self.error = f"{type(exc).__name__}: {exc}"
            return
        if not found:
            self.error = f"ModuleNotFoundError: No module named {module!r}"

    @property
    def summary(self) -> str:
        """The distribution's summary; the class docstring's first line when the
        distribution has none and the class is loaded."""
        if self.base is DatasetPlugin and self.distribution == "slipstream" and self.name in BUILTIN_SUMMARIES:
            return BUILTIN_SUMMARIES[self.name]
        if self.description:
            return self.description
        return self.cls.summary() if self.cls is not None else ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "entry_point": self.target,
            "summary": self.summary,
            "error": self.error,
            "imported": self.entry_point is None,  # whether load errors were looked for
        }


# Within one command (:func:`discovered_once`), each group is read from the installed
# distributions' metadata once: its config, plugins and data ask for the same groups.
_DISCOVERED: ContextVar[dict[tuple[str, Any], dict[str, PluginInfo]] | None] = ContextVar(
    "slipstream_discovered", default=None
)


@contextlib.contextmanager
def discovered_once() -> Iterator[None]:
    """Within, :func:`discover` reads each group once (a command's span: plugins
    installed meanwhile are not seen until the next)."""
    token = _DISCOVERED.set({})
    try:
        yield
    finally:
        _DISCOVERED.reset(token)


def discover(
    load: bool = True, group: str = ALGORITHMS_GROUP, base: type | None = None
) -> dict[str, PluginInfo]:
    """Every installed plugin of entry-point ``group`` (algorithms by default);
    with ``load``, imported too (and checked to subclass ``base``; by default
    the group's own base class, :class:`Algorithm` or :class:`Callback`). A failed
    import is recorded, not raised, so that one broken plugin does not hide the
    others. ``load=False`` defers imports to :func:`algorithm_class`, so a run
    imports only the plugins it uses; name, distribution, version and summary
    come from the distribution's metadata either way."""
    cache = _DISCOVERED.get()
    if cache is None or (group, base) not in cache:
        found = _entry_points(group, base)
        if cache is not None:
            cache[group, base] = found
    else:
        found = cache[group, base]
    if load:
        for info in found.values():
            info.load()
    return dict(found)


def _entry_points(group: str, base: type | None) -> dict[str, PluginInfo]:
    found: dict[str, PluginInfo] = {}
    for ep in sorted(metadata.entry_points(group=group), key=lambda e: e.name):
        dist = getattr(ep, "dist", None)
        info = PluginInfo(
            name=ep.name,
            distribution=dist.metadata["Name"] if dist is not None else "unknown",
            version=dist.version if dist is not None else "unknown",
            target=ep.value,
            entry_point=ep,
            # .get: once importlib_metadata (the backport, which mlflow and wandb
            # import) is loaded, its finder answers first, and its [] raises KeyError
            # for a field the distribution lacks.
            description=(dist.metadata.get("Summary") or "").strip() if dist is not None else "",
            base=base or GROUPS[group][0],
        )
        if ep.name in found:
            other = found[ep.name]
            if other.distribution == info.distribution:
                continue  # the same distribution seen twice on sys.path
            other.error = info.error = (
                f"the name {ep.name!r} is registered by two distributions: "
                f"{other.distribution} and {info.distribution}; uninstall one"
            )
            other.entry_point = None
            continue
        found[ep.name] = info
    return found


def list_installed(
    group: str = ALGORITHMS_GROUP, check: bool = False, base: type | None = None
) -> list[PluginInfo]:
    """What ``slipstream algorithms`` (and ``callbacks``, with its group) lists.

    Without ``check`` nothing is imported: metadata, plus a look-up of each entry
    point's module on the path. With ``check`` every plugin is imported, so that
    an import that fails inside the module (or exits) is reported too.
    """
    infos = list(discover(load=check, group=group, base=base).values())
    for info in infos:
        info.check_module()
    return infos


def algorithm_class(
    name: str, installed: dict[str, PluginInfo], group: str = ALGORITHMS_GROUP
) -> type[Plugin]:
    """The class registered as ``name`` in ``group``, or a clear error."""
    noun = GROUPS[group][1]
    info = installed.get(name)
    if info is None:
        listing = ", ".join(sorted(installed)) or "none"
        raise PluginError(
            f"unknown {noun} {name!r}{did_you_mean(name, installed)}; "
            f"installed {noun}s: {listing}"
        )
    info.load()
    if info.cls is None:
        raise PluginError(
            f"{noun} {name!r} (distribution {info.distribution} {info.version}, "
            f"entry point {name} = {info.target!r}) failed to load: {info.error}"
        )
    return info.cls


def plugin_config(cls: type[Plugin], options: dict[str, Any] | None, prefix: str | None = None, about: str = "") -> Any:
    """Validate ``options`` against ``cls.config_class`` and return the dataclass.

    An unknown key, a wrong type or an out-of-range value is a ConfigError that
    names the plugin (``algorithms.<name>`` or ``callbacks.<name>``; ``prefix`` and
    ``about`` where its keys are elsewhere: ``data`` and `` (dataset NAME)``), the
    key and what is allowed.
    """
    options = dict(options or {})
    name = prefix or f"{cls.kind}s.{cls.name}"
    if cls.config_class is None:
        if options:
            raise ConfigError(f"{name}{about} takes no options, got {sorted(options)}")
        return None
    fields = {f.name: f for f in dataclasses.fields(cls.config_class)}
    for key in options:
        if key not in fields:
            raise ConfigError(
                f"{name}{about}: unknown key {key!r}{did_you_mean(key, fields)}; "
                f"allowed keys: {', '.join(fields)}"
            )
    structured = _structured(cls.config_class)
    for key, value in options.items():
        # A mapping where a list belongs (or the reverse) fails inside omegaconf with
        # a TypeError that names no key: merge each container alone to name it.
        if isinstance(value, (dict, list)) and not isinstance(getattr(fields[key], "default", None), type(value)):
            try:
                OmegaConf.merge(structured, {key: value})
            except TypeError:
                field_type = _type_name(fields[key].type)
                raise ConfigError(f"{name}.{key}{about}: expected {field_type}, got {value!r}") from None
            except OmegaConfBaseException:
                pass  # reported with its key below
    try:
        merged = OmegaConf.merge(structured, options)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key, message = omegaconf_problem(exc)
        field_type = getattr(fields.get(key), "type", None)
        allowed = f"; expected {_type_name(field_type)}" if field_type is not None else ""
        raise ConfigError(f"{name}.{key}{about}: {message}{allowed}") from None
    except ConfigError:  # already names the plugin and key (parse_duration_option)
        raise
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{name}{about}: {exc}") from None


def instantiate(
    requested: dict[str, dict[str, Any] | None],
    installed: dict[str, PluginInfo],
    group: str = ALGORITHMS_GROUP,
) -> list[Any]:
    """Build every requested algorithm (or callback, with ``group``): unknown names
    and bad options fail here, before anything runs."""
    plugins = []
    for name, options in requested.items():
        cls = algorithm_class(name, installed, group)
        plugins.append(cls(plugin_config(cls, options)))
    return plugins


def build_plugins(
    algorithms: dict[str, Any],
    callbacks: dict[str, Any],
    installed: dict[str, PluginInfo] | None = None,
) -> tuple[list[Plugin], list[Plugin]]:
    """A run's algorithms and callbacks, built from their config sections (name to
    options) and checked: an unknown name or option is a ConfigError here. Only the
    named plugins are imported, so a command can check them before it imports the
    libraries its model and data need."""
    installed = discover(load=False) if installed is None else installed
    return (
        instantiate(algorithms, installed),
        instantiate(callbacks, discover(load=False, group=CALLBACKS_GROUP), CALLBACKS_GROUP),
    )


def resolve_order(
    algorithms: list[Algorithm], installed: Collection[str] | None = None
) -> list[Algorithm]:
    """One order for the run: declared constraints first, then the order given.

    Refuses duplicates, conflicts and cycles, naming both sides. With
    ``installed`` (the names of the installed algorithms), a ``runs_after`` or
    ``runs_before`` that names an algorithm neither installed nor in the run is
    warned about: it is most likely a typo, and it constrains nothing.
    """
    by_name: dict[str, Algorithm] = {}
    for algo in algorithms:
        if not algo.name:
            raise PluginError(f"{type(algo).__name__} has no name; set the class attribute `name`")
        if algo.name in by_name:
            raise PluginError(f"algorithm {algo.name!r} is enabled twice")
        by_name[algo.name] = algo
    for algo in algorithms:
        for other in algo.conflicts_with:
            if other in by_name:
                # conflicts_with may map each name to why (a dict), so the refusal says it.
                why = algo.conflicts_with.get(other) if isinstance(algo.conflicts_with, dict) else None
                raise PluginError(
                    f"algorithm {algo.name!r} conflicts with {other!r}"
                    + (f" ({why})" if why else "")
                    + "; enable only one of them"
                )
    if installed is not None:
        _warn_unknown_order_names(algorithms, set(installed) | set(by_name))
    # Edges "a before b", from both sides' declarations.
    after: dict[str, set[str]] = {name: set() for name in by_name}
    for algo in algorithms:
        after[algo.name].update(n for n in algo.runs_after if n in by_name)
        for n in algo.runs_before:
            if n in by_name:
                after[n].add(algo.name)
    position = {name: i for i, name in enumerate(by_name)}
    ordered: list[str] = []
    pending = dict(after)
    while pending:
        ready = [n for n, deps in pending.items() if not deps - set(ordered)]
        if not ready:
            raise PluginError(f"algorithm order has a cycle: {_find_cycle(pending, ordered)}")
        first = min(ready, key=position.__getitem__)
        ordered.append(first)
        del pending[first]
    return [by_name[n] for n in ordered]


def _warn_unknown_order_names(algorithms: list[Algorithm], known: set[str]) -> None:
    for algo in algorithms:
        for key in ("runs_after", "runs_before"):
            for other in getattr(algo, key):
                if other not in known:
                    warnings.warn(
                        f"algorithm {algo.name!r} declares {key}={other!r}, but no algorithm "
                        f"{other!r} is installed{did_you_mean(other, known)}; "
                        "the constraint is ignored",
                        stacklevel=3,
                    )


def check_hook_names(pm: pluggy.PluginManager) -> None:
    """Refuse a method marked as a hook whose name is no hook (a typo).

    Reports what pluggy's ``check_pending`` would find, but names the plugin, the
    method and the closest hook, so the error says what to fix.
    """
    specified = [name for name in vars(pm.hook) if getattr(pm.hook, name).has_spec()]
    for name in vars(pm.hook):
        caller = getattr(pm.hook, name)
        if name.startswith("_") or caller.has_spec():
            continue
        for impl in caller.get_hookimpls():
            if not impl.optionalhook:
                raise PluginError(
                    f"plugin {impl.plugin_name!r} ({type(impl.plugin).__name__}) marks "
                    f"method {name!r} as a hook, but there is no hook {name!r}"
                    f"{did_you_mean(name, specified)}; the hooks are listed in "
                    "slipstream.hookspecs"
                )
    pm.check_pending()  # anything the loop above does not know of yet


def unmarked_hooks(pm: pluggy.PluginManager, plugin: Any) -> list[str]:
    """The methods of ``plugin``'s own classes named as a hook but not marked
    ``@hookimpl``: pluggy passes them over, so the engine would never call them. The
    engine's base classes and torch's (an ``nn.Module``'s ``forward``) are left out."""
    hooks = {name for name in vars(pm.hook) if not name.startswith("_") and getattr(pm.hook, name).has_spec()}
    marker = f"{pm.project_name}_impl"
    found: list[str] = []
    seen: set[str] = set()  # defined by a class before in the MRO: that one is what counts
    for klass in type(plugin).__mro__:
        if klass is object or klass.__module__.split(".")[0] in ("slipstream", "torch"):
            continue
        for name, value in vars(klass).items():
            if name in seen:
                continue
            seen.add(name)
            function = getattr(value, "__func__", value)
            if name in hooks and callable(function) and not hasattr(function, marker):
                found.append(name)
    return found


def check_callbacks(callbacks: list[Callback], algorithms: list[Algorithm]) -> None:
    """Refuse a callback enabled twice, or one named as an algorithm of the run
    (checkpoints keep plugin state under the name)."""
    seen: set[str] = set()
    taken = {a.name for a in algorithms}
    for cb in callbacks:
        if not cb.name:
            raise PluginError(f"{type(cb).__name__} has no name; set the class attribute `name`")
        if cb.name in seen:
            raise PluginError(f"callback {cb.name!r} is enabled twice")
        if cb.name in taken:
            raise PluginError(
                f"callback {cb.name!r} has the name of an algorithm of this run; "
                "plugins of one run need distinct names"
            )
        seen.add(cb.name)


def check_callbacks_observe(pm: pluggy.PluginManager) -> None:
    """Refuse a callback that implements a step hook: a callback observes, so it
    may neither replace nor wrap a step (that is an algorithm's job)."""
    for step in STEPS:
        for impl in getattr(pm.hook, step).get_hookimpls():
            if isinstance(impl.plugin, Callback):
                raise PluginError(
                    f"callback {impl.plugin_name!r} ({type(impl.plugin).__name__}) implements "
                    f"the step hook {step!r}; a callback observes and may not replace or wrap "
                    f"a step ({', '.join(STEPS)}): make it an algorithm (entry-point group "
                    f"{ALGORITHMS_GROUP!r}, base class slipstream.Algorithm) instead"
                )


def _find_cycle(pending: dict[str, set[str]], done: list[str]) -> str:
    start = next(iter(pending))
    path = [start]
    while True:
        nxt = sorted(pending[path[-1]] - set(done))[0]
        if nxt in path:
            cycle = path[path.index(nxt) :] + [nxt]
            return " must run after ".join(cycle)
        path.append(nxt)


def distribution_of(
    algo: Plugin, installed: dict[str, PluginInfo] | None = None
) -> tuple[str, str]:
    """(distribution, version) for an algorithm or callback instance, for checkpoints
    and summaries."""
    if installed:
        info = installed.get(algo.name)
        if info is not None and info.cls is type(algo):
            return info.distribution, info.version
    top = type(algo).__module__.split(".")[0]
    for dist_name in _packages_distributions().get(top, []):
        try:
            return dist_name, metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            continue
    return "unknown", "unknown"


@functools.lru_cache(maxsize=1)
def _packages_distributions() -> dict[str, list[str]]:
    return metadata.packages_distributions()  # scans every installed package: once


def config_as_dict(algo: Plugin) -> dict[str, Any]:
    cfg = algo.config
    if cfg is None:
        return {}
    if dataclasses.is_dataclass(cfg):
        return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]
    return dict(cfg) if isinstance(cfg, dict) else {"value": repr(cfg)}


def algorithm_record(algo: Plugin, distribution: tuple[str, str]) -> dict[str, Any]:
    """How checkpoints and summary.json name an algorithm (or callback) of the run:
    name, version, distribution and config (``distribution`` from :func:`distribution_of`)."""
    dist, version = distribution
    return {"name": algo.name, "version": version, "distribution": dist, "config": config_as_dict(algo)}


@functools.cache
def _structured(config_class: type) -> Any:
    """omegaconf's schema of ``config_class``, made once (20 ms each; merges copy it)."""
    return OmegaConf.structured(config_class)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
