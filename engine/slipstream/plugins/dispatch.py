"""Calling the per-batch hooks without pluggy's per-call bookkeeping.

A pluggy hook call checks its arguments, copies the list of implementations and walks
it through the generic ``_multicall`` (wrappers, teardowns, result lists): about 5 us
per call on a CPU, and a training step fires some ten hooks. On the tiny-MLP workload
the peers are compared on (a step of ~1 ms) that alone was 5 % of the step.

:func:`bind` looks a hook up once, when the run starts, and returns the cheapest
callable with pluggy's semantics for what is registered then:

- nobody implements it: a no-op;
- only plain implementations (no ``wrapper``/``hookwrapper``): a closure that calls
  them in pluggy's order (last registered, ``tryfirst`` first), with the arguments
  each declares, stopping at the first non-None result of a ``firstresult`` hook;
  the lone implementation of a ``firstresult`` hook is returned itself (a step only
  the engine's default performs costs one plain call);
- any wrapper, or a plugin manager with tracing or call monitoring on: pluggy's own
  caller, unchanged.

:func:`bind_event` is the same for a caller that ignores what an event returns (the
loop): an event nobody implements is None, so the loop skips it with one test (a call
of a no-op costs about 1 us in situ, and most of the dozen per-batch events have no
implementation in a run), and a lone implementation is returned itself.

Exceptions propagate as pluggy propagates them. A plugin registered after binding is
not seen until the hooks are bound again (the trainer binds after ``init``, where
plugins may register helpers).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

import pluggy

from slipstream.errors import PluginError, did_you_mean


class PluginManager(pluggy.PluginManager):
    """pluggy's manager, registering a plugin object in a fraction of the time.

    pluggy 1.7 looks every attribute of a plugin up with ``inspect.getattr_static``
    to find its hook implementations: ~0.3 ms a plugin, ~2 ms of every run's start
    (the engine registers half a dozen services). Only the names that carry the
    ``@hookimpl`` marker in the plugin's class or instance can be hooks, so the others
    are skipped before that lookup; pluggy still parses the marked ones. Modules and
    classes registered as plugins take pluggy's path unchanged.
    """

    _marked_now: frozenset[str] | None = None

    def register(self, plugin: Any, name: str | None = None) -> str | None:
        outer = self._marked_now
        if not isinstance(plugin, (type, types.ModuleType)):
            self._marked_now = _marked(plugin, self.project_name + "_impl")
        try:
            return super().register(plugin, name)
        except pluggy.PluginValidationError as error:  # pluggy's is several lines, naming no fix
            raise PluginError(self._invalid(plugin, name, error)) from None
        finally:
            self._marked_now = outer

    def _invalid(self, plugin: Any, name: str | None, error: pluggy.PluginValidationError) -> str:
        """One line for a plugin pluggy refused: a hook method taking an argument the
        hook does not pass (a typo, most often) names it, the closest one and what the
        hook passes; anything else is pluggy's message on one line."""
        who = f"plugin {name or getattr(plugin, 'name', None) or type(plugin).__name__!r} ({type(plugin).__name__})"
        for hook in sorted(self._marked_now or ()):
            caller = getattr(self.hook, hook, None)
            spec = getattr(caller, "spec", None)
            if spec is None:
                continue
            try:
                parameters = inspect.signature(getattr(plugin, hook)).parameters.values()
            except (TypeError, ValueError):
                continue
            positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            unknown = [p.name for p in parameters if p.kind in positional and p.name not in spec.argnames]
            if unknown:
                hints = "".join(f" {a!r}{did_you_mean(a, spec.argnames)}" for a in unknown)
                return (
                    f"{who}: its hook method {hook!r} takes{hints}, which the hook does not pass; "
                    f"{hook!r} passes {', '.join(spec.argnames)} (take any of them, by these names)"
                )
        return f"{who}: " + " ".join(str(error).split())

    def parse_hookimpl_opts(self, plugin: Any, name: str) -> Any:
        marked = self._marked_now
        if marked is not None and name not in marked:
            return None
        return super().parse_hookimpl_opts(plugin, name)


def _is_marked(value: Any, marker: str) -> bool:
    try:
        return hasattr(value, marker) or hasattr(getattr(value, "__func__", None), marker)
    except Exception:  # a value whose attribute look-up raises: pluggy decides
        return True


def _marked(plugin: Any, marker: str) -> frozenset[str]:
    """The names in ``plugin``'s own ``__dict__`` and its classes' whose value carries
    ``marker``. Read afresh at each registration: a class patched since is seen."""
    try:
        own = object.__getattribute__(plugin, "__dict__")  # not through __getattr__
    except AttributeError:
        own = None
    spaces = [vars(klass) for klass in type(plugin).__mro__]
    if isinstance(own, dict):
        spaces.append(own)
    return frozenset(name for space in spaces for name, value in space.items() if _is_marked(value, marker))


def plugin_manager(project: str, specs: Any) -> PluginManager:
    """A :class:`PluginManager` for ``project`` with the hook specifications of ``specs``."""
    pm = PluginManager(project)
    pm.add_hookspecs(specs)
    return pm


# What a plugin manager runs hook calls through when nobody traces or monitors them
# (read off a fresh one, so no private name of pluggy is imported).
_PLAIN = getattr(pluggy.PluginManager("slipstream-probe"), "_inner_hookexec", object())


def _noop(**_: Any) -> None:
    return None


def _keyword_call(impl: Any, spec_args: frozenset[str]) -> Callable[..., Any]:
    """``impl``'s function, callable with the hook's keyword arguments."""
    function, argnames = impl.function, impl.argnames
    if frozenset(argnames) == spec_args:
        return function  # it declares every argument: the keywords go straight in

    def some(**kwargs: Any) -> Any:  # it declares fewer, as pluggy allows
        return function(*[kwargs[a] for a in argnames])

    return some


def bind(pm: pluggy.PluginManager, name: str) -> Callable[..., Any]:
    """The callable for hook ``name`` as ``pm`` stands now (see the module doc)."""
    call = _bind(pm, name, results=True)
    return _noop if call is None else call


def bind_event(pm: pluggy.PluginManager, name: str) -> Callable[..., None] | None:
    """For a caller that ignores what event ``name`` returns (the loop does): None
    when nobody implements it, so the caller can skip it; the lone plain
    implementation itself; several called in turn without collecting results."""
    return _bind(pm, name, results=False)


def _bind(pm: pluggy.PluginManager, name: str, results: bool) -> Callable[..., Any] | None:
    caller = getattr(pm.hook, name)
    impls = caller.get_hookimpls()
    if not impls:
        return None
    monitored = getattr(pm, "_inner_hookexec", None) is not _PLAIN
    if monitored or caller.spec is None or any(i.wrapper or i.hookwrapper or i.kwargnames for i in impls):
        return caller
    spec_args = frozenset(caller.spec.argnames)
    calls = [_keyword_call(i, spec_args) for i in reversed(impls)]  # pluggy's call order
    if caller.spec.opts.get("firstresult"):
        if len(calls) == 1:
            return calls[0]  # the one result, or None: what pluggy returns

        def first(**kwargs: Any) -> Any:
            for call in calls:
                result = call(**kwargs)
                if result is not None:
                    return result
            return None

        return first

    if not results:
        if len(calls) == 1:
            return calls[0]

        def each(**kwargs: Any) -> None:
            for call in calls:
                call(**kwargs)

        return each

    if len(calls) == 1:
        (only,) = calls

        def one(**kwargs: Any) -> list[Any]:
            result = only(**kwargs)
            return [] if result is None else [result]

        return one

    def every(**kwargs: Any) -> list[Any]:
        found = []
        for call in calls:
            result = call(**kwargs)
            if result is not None:
                found.append(result)
        return found

    return every
