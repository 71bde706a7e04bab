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

Two checks cost nothing on the way: :func:`step_result_check` is what the trainer's
wrapper around a plugin's step (which it has anyway, for None) applies to the result
(``should_step`` returns a bool, ``compute_loss`` a scalar tensor, ...), and
:func:`blame`, called only once a run has failed, reads the traceback for the plugin
and hook that raised.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

import pluggy

from slipstream.errors import PluginError, did_you_mean
from slipstream.hookspecs import NOT_MINE, STEPS


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


# -- what a step returns, and who raised -------------------------------------------------------


def _scalar_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor) and value.numel() == 1


def _module(value: Any) -> bool:
    from torch import nn

    return isinstance(value, nn.Module)


# What the loop does with a step's result decides what it may be (hookspecs states it);
# backward and load_state_dicts say only that they are done, and forward returns what the
# model does. NOT_MINE and None are the caller's business (see Trainer._check_step_replacements).
STEP_RESULTS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "compute_loss": (_scalar_tensor, "a scalar tensor (the loss, computed from state.outputs: no .item() or float())"),
    "should_step": (lambda v: isinstance(v, bool), "True or False (whether the optimizer steps after this batch)"),
    "optimizer_step": (lambda v: isinstance(v, bool), "True or False (whether the optimizer stepped)"),
    "wrap_model": (_module, "a torch.nn.Module (the model to train)"),
    "state_dicts": (lambda v: isinstance(v, dict), 'a dict {"model": ..., "optimizer": ...}'),
}


def step_result_check(plugin: str, step: str, wraps: bool = False) -> Callable[[Any], None] | None:
    """For a plugin's implementation of ``step``: a check that raises a one-line
    :class:`PluginError` naming the plugin, the step, what it returned and what is allowed,
    when the result is of another kind; None when the step allows any result."""
    if step not in STEP_RESULTS:
        return None
    allowed, what = STEP_RESULTS[step]
    how = "wraps" if wraps else "replaces"

    def check(result: Any) -> None:
        if not allowed(result):
            shown = repr(result)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise PluginError(
                f"plugin {plugin!r} {how} the '{step}' step and returned a {type(result).__name__} ({shown}); "
                f"'{step}' must return {what}"
            )

    return check


_RAISED_IN = "_slipstream_raised_in"


def blame(pm: pluggy.PluginManager, error: BaseException, plugins: Any = None) -> str | None:
    """``"plugin 'NAME' raised in HOOK"`` when ``error`` came out of a hook
    implementation of a plugin of ``pm`` (of ``plugins`` alone, when given: the run's
    algorithms and callbacks, not the engine's services), else None. The deepest hook
    implementation in the traceback is the one that raised (an error of the engine's
    step under a plugin's wrapper passes through the wrapper too: it is not the plugin's).
    The answer is kept on the error (see :func:`raised_in`) and added to it as a note,
    which its traceback shows.

    Only read after a failure: the loop calls hooks with no bookkeeping of its own."""
    if not isinstance(error, Exception):
        return None  # Ctrl-C while a plugin ran is not the plugin's doing
    known = getattr(error, _RAISED_IN, None)
    if known is not None:
        return known
    wanted = None if plugins is None else {id(p) for p in plugins}
    codes: dict[Any, list[tuple[Any, str, str]]] = {}
    for hook in vars(pm.hook):
        caller = getattr(pm.hook, hook)
        if hook.startswith("_") or not hasattr(caller, "get_hookimpls"):
            continue
        for impl in caller.get_hookimpls():  # every one: an engine's, deeper, is no plugin's doing
            function = inspect.unwrap(impl.function)
            code = getattr(getattr(function, "__func__", function), "__code__", None)
            if code is not None:
                codes.setdefault(code, []).append((impl.plugin, impl.plugin_name, hook))
    found: list[tuple[Any, str, str]] = []
    tb = error.__traceback__
    while tb is not None:  # outermost first: the last match is the deepest
        matches = codes.get(tb.tb_frame.f_code)
        if matches:
            this = tb.tb_frame.f_locals.get("self", None)  # one class's code serves each instance
            found = [m for m in matches if m[0] is this] or matches
        tb = tb.tb_next
    if wanted is not None and any(id(plugin) not in wanted for plugin, _, _ in found):
        return None  # the engine's own step raised (under a plugin's wrapper, maybe): no plugin's
    names = sorted({name for _, name, _ in found})
    if len(names) != 1 or f"plugin {names[0]!r}" in str(error):  # none, unclear, or the error names it
        return None
    hooks = sorted({hook for _, _, hook in found})  # one function may serve several hooks
    where = f"plugin {names[0]!r} raised in {hooks[0] if len(hooks) == 1 else 'one of its hooks'}"
    try:
        setattr(error, _RAISED_IN, where)
        error.add_note(f"slipstream: {where}")
    except (AttributeError, TypeError):  # an exception type that takes no attributes
        return None
    return where


def raised_in(error: BaseException) -> str | None:
    """What :func:`blame` found for ``error`` (None: nothing, or it was not asked)."""
    return getattr(error, _RAISED_IN, None)


def error_text(error: BaseException) -> str:
    """``"TYPE: message"``, after ``"plugin 'NAME' raised in HOOK: "`` when :func:`blame`
    named one: what a summary and a one-line report say of a failure."""
    text = f"{type(error).__name__}: {error}"
    where = raised_in(error)
    return f"{where}: {text}" if where else text


def check_step_implementations(pm: pluggy.PluginManager, engine_steps: Any) -> None:
    """Each step replaced by at most one plugin (besides ``engine_steps``, the engine's
    own), and every plugin's step implementation wrapped in its result check (this is
    the one place that rewrites pluggy's ``HookImpl.function``)."""
    for step in STEPS:
        impls = [
            impl
            for impl in getattr(pm.hook, step).get_hookimpls()
            if not (impl.wrapper or impl.hookwrapper) and impl.plugin is not engine_steps
        ]
        for impl in impls:
            if not getattr(impl.function, "_slipstream_checked", False):
                impl.function = _checked_step(impl.function, impl.plugin_name, step)
        for impl in getattr(pm.hook, step).get_hookimpls():
            if impl.wrapper and not getattr(impl.function, "_slipstream_checked", False):
                impl.function = _checked_wrapper(impl.function, impl.plugin_name, step)
        replacing = [impl.plugin_name for impl in impls]
        if len(replacing) > 1:
            raise PluginError(
                f"plugins {replacing[0]!r} and {replacing[1]!r} both replace the '{step}' step, "
                "so only one of them could run; disable one, or make one wrap the step "
                "with @hookimpl(wrapper=True)"
            )


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
        if result is NOT_MINE:
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
