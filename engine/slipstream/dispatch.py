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
- any wrapper, or a plugin manager with tracing or call monitoring on: pluggy's own
  caller, unchanged.

Exceptions propagate as pluggy propagates them. A plugin registered after binding is
not seen until the hooks are bound again (the trainer binds after ``init``, where
plugins may register helpers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

# What a plugin manager runs hook calls through when nobody traces or monitors them
# (read off a fresh one, so no private name of pluggy is imported).
_PLAIN = getattr(pluggy.PluginManager("slipstream-probe"), "_inner_hookexec", object())


def _noop(**_: Any) -> None:
    return None


def bind(pm: pluggy.PluginManager, name: str) -> Callable[..., Any]:
    """The callable for hook ``name`` as ``pm`` stands now (see the module doc)."""
    caller = getattr(pm.hook, name)
    impls = caller.get_hookimpls()
    if not impls:
        return _noop
    monitored = getattr(pm, "_inner_hookexec", None) is not _PLAIN
    if monitored or any(i.wrapper or i.hookwrapper or i.kwargnames for i in impls):
        return caller
    firstresult = bool(caller.spec and caller.spec.opts.get("firstresult"))
    calls = [(i.function, i.argnames) for i in reversed(impls)]  # pluggy's call order
    if firstresult:

        def first(**kwargs: Any) -> Any:
            for function, argnames in calls:
                result = function(*[kwargs[a] for a in argnames])
                if result is not None:
                    return result
            return None

        return first

    def every(**kwargs: Any) -> list[Any]:
        results = []
        for function, argnames in calls:
            result = function(*[kwargs[a] for a in argnames])
            if result is not None:
                results.append(result)
        return results

    return every
