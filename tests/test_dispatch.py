"""slipstream.plugins.dispatch.bind calls the per-batch hooks as pluggy would: same order, same
first-result rule, same exceptions; it hands wrappers and traced managers to pluggy. Its
PluginManager registers the same hooks as pluggy's."""

from __future__ import annotations

import types

import pluggy
import pytest
import torch

from helpers import tiny_loaders, tiny_model
from slipstream import Algorithm, Trainer, hookimpl, hookspecs
from slipstream.plugins.discovery import ALGORITHMS_GROUP, CALLBACKS_GROUP, discover, plugin_config
from slipstream.plugins.dispatch import bind, plugin_manager


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


# -- registration ---------------------------------------------------------------


def _impls(pm: pluggy.PluginManager, plugin: object) -> set[tuple]:
    """What ``pm`` registered of ``plugin``: each hook with its function and options."""
    return {
        (caller.name, impl.function.__name__, impl.tryfirst, impl.trylast, impl.wrapper, impl.hookwrapper)
        for caller in pm.get_hookcallers(plugin) or ()
        for impl in caller.get_hookimpls()
        if impl.plugin is plugin
    }


def _both(plugin: object) -> tuple[set[tuple], set[tuple]]:
    ours = plugin_manager(hookspecs.PROJECT, hookspecs)
    theirs = pluggy.PluginManager(hookspecs.PROJECT)
    theirs.add_hookspecs(hookspecs)
    ours.register(plugin, name="p")
    theirs.register(plugin, name="p")
    return _impls(ours, plugin), _impls(theirs, plugin)


def test_the_engines_manager_registers_what_pluggy_registers_for_every_real_plugin(tmp_path):
    """The fast registration skips unmarked names: for the engine's services and every
    installed algorithm and callback it must find exactly the hooks pluggy finds."""
    train_data, _ = tiny_loaders()
    model = tiny_model()
    trainer = Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      train_data=train_data, run_dir=tmp_path / "run", progress_bar=True, verbose=False)
    plugins = [p for _, p in trainer.pm.list_name_plugin()]
    for group in (ALGORITHMS_GROUP, CALLBACKS_GROUP):
        for info in discover(group=group).values():
            try:
                plugins.append(info.cls(plugin_config(info.cls, None)))
            except Exception:  # one that needs options of its own: its class is checked below
                continue
    assert len(plugins) > 15
    for plugin in plugins:
        ours, theirs = _both(plugin)
        assert ours == theirs, type(plugin).__name__
        assert theirs or not isinstance(plugin, Algorithm), f"{type(plugin).__name__} implements no hook"


def test_hooks_on_the_instance_and_patched_onto_the_class_are_registered():
    class Late:
        pass

    plugin = Late()
    plugin.batch_end = hookimpl(lambda state: None)  # on the instance
    ours, theirs = _both(plugin)
    assert {name for name, *_ in ours} == {name for name, *_ in theirs} == {"batch_end"}

    Late.fit_end = hookimpl(lambda self, state: None)  # on the class, after it was first seen
    ours, theirs = _both(Late())
    assert {name for name, *_ in ours} == {name for name, *_ in theirs} == {"fit_end"}

    class Child(Late):  # inherited
        @hookimpl(tryfirst=True)
        def eval_end(self, state: object) -> None: ...

    ours, theirs = _both(Child())
    assert ours == theirs and {name for name, *_ in ours} == {"fit_end", "eval_end"}


def test_a_class_attribute_whose_look_up_raises_does_not_break_registration():
    class Touchy:
        def __getattr__(self, name: str) -> None:
            raise KeyError(name)  # not an AttributeError: hasattr() would raise it

    class Plugin:
        helper = Touchy()

        @hookimpl
        def batch_end(self, state: object) -> None: ...

    ours, theirs = _both(Plugin())
    assert ours == theirs and {name for name, *_ in ours} == {"batch_end"}


def test_a_module_plugin_takes_pluggys_path():
    module = types.ModuleType("a_plugin")
    module.batch_end = hookimpl(lambda state: None)
    ours, theirs = _both(module)
    assert ours == theirs and {name for name, *_ in ours} == {"batch_end"}
