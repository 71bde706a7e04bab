"""slipstream.plugins.dispatch.bind calls the per-batch hooks as pluggy would: same order, same
first-result rule, same exceptions; it hands wrappers and traced managers to pluggy."""

from __future__ import annotations

import pluggy
import pytest

from slipstream import hookimpl, hookspecs
from slipstream.plugins.dispatch import bind


def manager(*plugins: object) -> pluggy.PluginManager:
    pm = pluggy.PluginManager("slipstream")
    pm.add_hookspecs(hookspecs)
    for i, plugin in enumerate(plugins):
        pm.register(plugin, name=f"p{i}")
    return pm


class Recorder:
    def __init__(self, tag: str, calls: list[str], result: object = None) -> None:
        self.tag, self.calls, self.result = tag, calls, result

    @hookimpl
    def batch_end(self, state: object) -> object:
        self.calls.append(self.tag)
        return self.result

    @hookimpl
    def should_step(self, state: object) -> object:
        self.calls.append(self.tag)
        return self.result


class First:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    @hookimpl(tryfirst=True)
    def batch_end(self, state: object) -> None:
        self.calls.append("first")


def test_events_run_every_implementation_in_pluggys_order():
    calls: list[str] = []
    pm = manager(Recorder("a", calls, 1), First(calls), Recorder("b", calls), Recorder("c", calls, 3))
    via_pluggy = pm.hook.batch_end(state=None)
    expected, calls[:] = list(calls), []
    assert bind(pm, "batch_end")(state=None) == via_pluggy == [3, 1]
    assert calls == expected == ["first", "c", "b", "a"]


def test_a_step_stops_at_the_first_result_as_pluggy_does():
    calls: list[str] = []
    pm = manager(Recorder("a", calls, "from a"), Recorder("b", calls, None), Recorder("c", calls, "from c"))
    via_pluggy = pm.hook.should_step(state=None)
    expected, calls[:] = list(calls), []
    assert bind(pm, "should_step")(state=None) == via_pluggy == "from c"
    assert calls == expected == ["c"]


def test_a_hook_nobody_implements_is_a_no_op():
    assert bind(manager(), "batch_end")(state=None) is None


def test_exceptions_propagate():
    class Boom:
        @hookimpl
        def batch_end(self, state: object) -> None:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        bind(manager(Boom()), "batch_end")(state=None)


def test_wrappers_and_traced_managers_keep_pluggys_caller():
    class Wraps:
        @hookimpl(wrapper=True)
        def batch_end(self, state: object):
            return (yield)

    pm = manager(Recorder("a", []), Wraps())
    assert bind(pm, "batch_end") is pm.hook.batch_end
    traced = manager(Recorder("a", []))
    traced.add_hookcall_monitoring(lambda *a: None, lambda *a: None)
    assert bind(traced, "batch_end") is traced.hook.batch_end


def test_an_implementation_may_declare_fewer_arguments_than_the_spec():
    seen: list[object] = []

    class NoArgs:  # pluggy passes each implementation only the arguments it names
        @hookimpl
        def log_metrics(self, record: dict) -> None:
            seen.append(record)

    class Both:
        @hookimpl
        def log_metrics(self, state: object, record: dict) -> str:
            seen.append(state)
            return "both"

    pm = manager(NoArgs())
    assert bind(pm, "log_metrics")(state="s", record={"loss": 1.0}) == [] == pm.hook.log_metrics(
        state="s", record={"loss": 1.0}
    )
    assert seen == [{"loss": 1.0}] * 2
    seen.clear()
    pm = manager(NoArgs(), Both())
    assert bind(pm, "log_metrics")(state="s", record={}) == ["both"]
    assert seen == ["s", {}]


def test_a_step_with_one_implementation_is_called_directly_with_its_result():
    calls: list[str] = []
    for result in ("stepped", None, False):
        pm = manager(Recorder("only", calls, result))
        assert bind(pm, "should_step")(state=None) == pm.hook.should_step(state=None)
    assert calls == ["only"] * 6


def test_an_event_for_a_caller_that_ignores_results_is_none_the_lone_plugin_or_each_in_order():
    from slipstream.plugins.dispatch import bind_event

    assert bind_event(manager(), "batch_end") is None  # nobody implements it: the loop skips it
    calls: list[str] = []
    lone = Recorder("only", calls, "ignored")
    bind_event(manager(lone), "batch_end")(state=None)
    assert calls == ["only"]
    calls.clear()
    pm = manager(Recorder("a", calls, 1), First(calls), Recorder("b", calls))
    pm.hook.batch_end(state=None)
    expected, calls[:] = list(calls), []
    assert bind_event(pm, "batch_end")(state=None) is None
    assert calls == expected == ["first", "b", "a"]  # pluggy's order, results not collected
