"""The hook contract as slipstream.hookspecs states it: refused typos, the call order,
normalisation after every batch transform, when state is loaded, what is training-only."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

from helpers import Probe, tiny_loaders, tiny_model, train
from slipstream import Algorithm, Callback, PluginError, Trainer, hookimpl, hookspecs
from slipstream.hookspecs import STEPS

NORMALIZE = ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))


# -- hooks whose name is no hook ------------------------------------------------------------


class Typo(Algorithm):
    name = "typo"

    @hookimpl
    def batch_stat(self, state):  # meant batch_start
        pass


def test_a_misspelt_hook_is_refused_naming_plugin_method_and_closest_hook(tmp_path):
    with pytest.raises(PluginError, match=r"'typo'.*'batch_stat'.*did you mean 'batch_start'"):
        train(tmp_path, [Typo()], max_duration="1ba")


def test_a_correctly_named_hook_of_the_same_plugin_is_accepted(tmp_path):
    class Fixed(Algorithm):
        name = "typo"

        @hookimpl
        def batch_start(self, state):
            pass

    train(tmp_path, [Fixed()], max_duration="1ba", eval_interval=None)


def test_a_hook_argument_the_hook_does_not_pass_is_one_clear_error(tmp_path):
    class TypoArgument(Algorithm):
        name = "typo_arg"

        @hookimpl
        def batch_start(self, stat):  # meant state
            pass

    with pytest.raises(PluginError) as caught:
        train(tmp_path, [TypoArgument()], max_duration="1ba")
    message = str(caught.value)
    assert "\n" not in message
    assert re.search(r"'typo_arg'.*'batch_start' takes 'stat' \(did you mean 'state'\?\).*passes state", message)


def test_a_wrapper_that_is_no_generator_is_one_clear_error(tmp_path):
    class NotAGenerator(Algorithm):
        name = "no_yield"

        @hookimpl(wrapper=True)
        def forward(self, state):
            return None

    with pytest.raises(PluginError, match=r"^plugin 'no_yield' \(NotAGenerator\): .*not a generator function"):
        train(tmp_path, [NotAGenerator()], max_duration="1ba")


def test_a_method_named_as_a_hook_without_hookimpl_is_warned_and_marking_it_is_silent(tmp_path):
    calls = []

    class Unmarked(Algorithm):
        name = "unmarked"

        def batch_start(self, state):  # @hookimpl forgotten: pluggy passes it over
            calls.append(1)

        def helper(self):  # no hook's name: nothing to say
            pass

    with pytest.warns(UserWarning, match=r"'unmarked' \(Unmarked\) defines 'batch_start'.*without @hookimpl"):
        train(tmp_path / "a", [Unmarked()], max_duration="1ba", eval_interval=None)
    assert calls == []

    class Marked(Unmarked):
        @hookimpl
        def batch_start(self, state):
            calls.append(1)

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*without @hookimpl")
        train(tmp_path / "b", [Marked()], max_duration="1ba", eval_interval=None)
    assert calls == [1]


class Helper:
    @hookimpl
    def after_optimiser_step(self, state):  # British spelling: no such hook
        pass


class RegistersHelperAtInit(Algorithm):
    name = "registers_helper"

    def __init__(self, pm_holder):
        super().__init__()
        self.pm_holder = pm_holder

    @hookimpl
    def init(self, state):
        self.pm_holder["pm"].register(Helper(), name="registers_helper.helper")


def test_a_misspelt_hook_registered_at_init_is_refused_before_the_first_batch(tmp_path):
    from helpers import tiny_loaders, tiny_model
    from slipstream import Trainer

    holder: dict = {}
    seen = Probe()
    model = tiny_model()
    train_data, _ = tiny_loaders()
    trainer = Trainer(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        train_data=train_data,
        max_duration="1ba",
        algorithms=[RegistersHelperAtInit(holder), seen],
        run_dir=tmp_path / "run",
        device="cpu",
        progress_bar=False,
        verbose=False,
    )
    holder["pm"] = trainer.pm
    with pytest.raises(PluginError, match=r"'after_optimiser_step'.*'after_optimizer_step'"):
        trainer.fit()
    assert "batch_start" not in seen.events


# -- order declarations naming algorithms that are not installed ----------------------------


class AfterMisspelt(Algorithm):
    name = "after_misspelt"
    runs_after = ("chanels_last",)


class AfterInstalled(Algorithm):
    name = "after_installed"
    runs_after = ("channels_last",)  # installed, only not in this run: fine


def test_runs_after_an_algorithm_that_is_not_installed_warns(tmp_path):
    with pytest.warns(UserWarning, match=r"'after_misspelt'.*'chanels_last'.*'channels_last'"):
        train(tmp_path, [AfterMisspelt()], max_duration="1ba", eval_interval=None)


def test_runs_after_an_installed_algorithm_outside_the_run_is_silent(tmp_path):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*runs_after.*")
        train(tmp_path, [AfterInstalled()], max_duration="1ba", eval_interval=None)


# -- normalisation is last, whatever plugins do ---------------------------------------------


class LateTransform(Algorithm):
    """A third-party transform that asks to run last at batch_start."""

    name = "late_transform"

    def __init__(self):
        super().__init__()
        self.train_min: list[float] = []
        self.eval_min: list[float] = []

    @hookimpl(trylast=True)
    def batch_start(self, state):
        self.train_min.append(float(state.batch[0].min()))

    @hookimpl(trylast=True)
    def eval_batch_start(self, state):
        self.eval_min.append(float(state.batch[0].min()))


def test_a_trylast_transform_sees_inputs_before_normalisation(tmp_path):
    from slipstream_channels_last import ChannelsLast

    late = LateTransform()
    model_min: list[float] = []
    probe = Probe(before_forward=lambda s: model_min.append(float(s.batch[0].min())))
    # channels_last has a trylast batch transform too: normalisation still comes after it.
    train(
        tmp_path,
        [ChannelsLast(), late, probe],
        max_duration="2ba",
        normalize=NORMALIZE,
    )
    # The toy images are in [0, 1] with pixels at 0: normalised, those become -2.
    assert late.train_min and min(late.train_min) >= 0.0
    assert late.eval_min and min(late.eval_min) >= 0.0
    assert model_min == pytest.approx([(m - 0.5) / 0.25 for m in late.train_min])


def test_the_model_receives_normalised_inputs_and_without_normalize_raw_ones(tmp_path):
    raw: list[torch.Tensor] = []
    fed: list[torch.Tensor] = []
    probe = Probe(
        batch_start=lambda s: raw.append(s.batch[0].clone()),
        before_forward=lambda s: fed.append(s.batch[0].clone()),
    )
    train(tmp_path / "on", [probe], max_duration="1ba", eval_interval=None, normalize=NORMALIZE)
    torch.testing.assert_close(fed[0], (raw[0] - 0.5) / 0.25)
    raw.clear(), fed.clear()
    train(tmp_path / "off", [probe], max_duration="1ba", eval_interval=None)
    assert torch.equal(fed[0], raw[0])


# -- pluggy's call order, as hookspecs.py writes it -----------------------------------------


def _documented_order() -> list[str]:
    """The call order hookspecs.py writes: "algorithms", engine services, "callbacks"."""
    doc = hookspecs.__doc__
    block = doc[doc.index("    algorithms, in the resolved order") : doc.index("callbacks, in the order given")]
    return ["algorithms", *re.findall(r"-> (engine\.\w+)", block), "callbacks"]


def _documented_tiers() -> set[tuple[str, str, str]]:
    return set(re.findall(r"``(engine\.\w+)``'s ``(\w+)`` is ``(tryfirst|trylast)``", hookspecs.__doc__))


class Observer(Callback):
    name = "observer"


def _full_trainer(tmp_path) -> Trainer:
    """A Trainer with every optional service the order names (target, progress bar),
    two algorithms and two callbacks, built as users build one (not fitted)."""
    first, second = Tagger("first", []), Tagger("second", [])
    one, two = Observer(), Observer()
    two.name = "observer_two"
    model = tiny_model()
    train_data, eval_data = tiny_loaders()
    return Trainer(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        train_data=train_data,
        eval_data=eval_data,
        max_duration="1ba",
        algorithms=[first, second],
        callbacks=[one, two],
        target_accuracy=0.5,
        progress_bar=True,
        run_dir=tmp_path / "run",
        device="cpu",
        verbose=False,
    )


def test_documented_call_order_is_the_registration_order(tmp_path):
    trainer = _full_trainer(tmp_path)
    algorithms = {a.name for a in trainer.algorithms}
    callbacks = [c.name for c in trainer.callbacks]
    # pluggy calls plain implementations last registered first.
    called = [name for name, _ in reversed(trainer.pm.list_name_plugin())]
    grouped = []
    for name in called:
        label = "algorithms" if name in algorithms else "callbacks" if name in callbacks else name
        if not grouped or grouped[-1] != label:
            grouped.append(label)
    assert grouped == _documented_order()
    assert [n for n in called if n in algorithms] == ["first", "second"]  # the resolved order
    assert [n for n in called if n in callbacks] == callbacks  # the order given


def test_documented_tier_exceptions_are_the_services_marks(tmp_path):
    trainer = _full_trainer(tmp_path)
    marked = set()
    for name, plugin in trainer.pm.list_name_plugin():
        if not name.startswith("engine."):
            continue
        for caller in trainer.pm.get_hookcallers(plugin):
            impl = next(i for i in caller.get_hookimpls() if i.plugin is plugin)
            for tier in ("tryfirst", "trylast"):
                if getattr(impl, tier):
                    marked.add((name, caller.name, tier))
    steps = {("engine.steps", step, "trylast") for step in STEPS}
    assert steps <= marked  # "engine.steps provides every step as trylast"
    assert marked - steps == _documented_tiers()


class Ordered(Algorithm):
    """At batch_end, logs its label; marked tryfirst, trylast or plain."""

    def __init__(self, name, log, **marks):
        super().__init__()
        self.name = name

        @hookimpl(**marks)
        def batch_end(state):
            log.append(name)

        self.batch_end = batch_end


class LogsBatchEnd(Callback):
    def __init__(self, name, log):
        super().__init__()
        self.name, self.log = name, log

    @hookimpl
    def batch_end(self, state):
        self.log.append(self.name)


class SeesTheRecords(Callback):
    """Observes, at eval_end and fit_end, what the engine recorded at that event."""

    name = "sees_the_records"

    def __init__(self, log):
        super().__init__()
        self.log = log
        self.best_at_eval_end: list[bool] = []
        self.summary_at_fit_end = False

    @hookimpl
    def batch_end(self, state):
        self.log.append(self.name)

    @hookimpl
    def eval_end(self, state):
        self.best_at_eval_end.append((state.run_dir / "checkpoints" / "best.pt").exists())

    @hookimpl
    def fit_end(self, state):
        self.summary_at_fit_end = (state.run_dir / "summary.json").exists()


def test_the_loop_calls_tiers_in_the_documented_order(tmp_path):
    """Through the real loop (the bound hooks of slipstream.plugins.dispatch, not a test-built
    plugin manager): tiers, the resolved order, and callbacks after the engine."""
    log: list[str] = []
    algorithms = [
        Ordered("late", log, trylast=True),
        Ordered("plain_a", log),
        Ordered("early", log, tryfirst=True),
        Ordered("plain_b", log),
    ]
    observer = SeesTheRecords(log)
    train(tmp_path, algorithms, max_duration="2ba", eval_interval="1ba", callbacks=[observer])
    per_batch = ["early", "plain_a", "plain_b", "sees_the_records", "late"]
    assert log == per_batch * 2
    assert observer.best_at_eval_end == [True, True]  # each evaluation, the last being the final one
    assert observer.summary_at_fit_end


class Tagger(Algorithm):
    """Records, at every start and end event, that it ran (in a shared log)."""

    def __init__(self, name, log):
        super().__init__()
        self.name = name
        self.log = log

    def _note(self, event):
        self.log.append((event, self.name))


for _event in ("fit_start", "fit_end", "epoch_start", "epoch_end", "batch_start", "batch_end",
               "eval_start", "eval_end", "eval_batch_start", "eval_batch_end"):  # fmt: skip

    def _handler(self, state, _event=_event):
        self._note(_event)

    _handler.__name__ = _event
    setattr(Tagger, _event, hookimpl(_handler))


def test_end_events_run_in_the_order_of_start_events(tmp_path):
    log: list[tuple[str, str]] = []
    first, second = Tagger("first", log), Tagger("second", log)
    second.runs_before = ("first",)  # the resolved order is second, first
    train(tmp_path, [first, second], max_duration="1ep")
    for event in ("fit", "epoch", "batch", "eval", "eval_batch"):
        for edge in ("start", "end"):
            order = [name for e, name in log if e == f"{event}_{edge}"][:2]
            assert order == ["second", "first"], (event, edge, order)


class CountsAtBatchEnd(Algorithm):
    name = "counts_at_batch_end"

    @hookimpl
    def batch_end(self, state):
        state.metrics["seen_batch"] = state.timestamp.batch


def test_algorithms_act_before_the_engine_records_at_the_same_event(tmp_path):
    trainer = train(
        tmp_path, [CountsAtBatchEnd()], max_duration="4ba", log_interval=2, eval_interval=None
    )
    lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    train_records = [r for r in records if r["kind"] == "train"]
    assert [(r["step"], r["seen_batch"]) for r in train_records] == [(2, 2), (4, 4)]


# -- persistence and training-only steps ----------------------------------------------------


class Stateful(Probe):
    name = "stateful"

    def state_dict(self):
        return {"value": 1}

    def load_state_dict(self, state):
        self.events.append("load_state_dict")


def test_load_state_dict_runs_after_init_and_before_fit_start(tmp_path):
    first = train(tmp_path / "a", [Stateful()], max_duration="2ba", eval_interval=None)
    resumed = Stateful()
    train(
        tmp_path / "b",
        [resumed],
        max_duration="3ba",
        eval_interval=None,
        load_path=first.run_dir / "checkpoints" / "latest.pt",
    )
    assert resumed.events[:3] == ["init", "load_state_dict", "fit_start"]


class ConstantLoss(Algorithm):
    name = "constant_loss"

    def __init__(self):
        super().__init__()
        self.calls_in_eval = 0

    @hookimpl
    def compute_loss(self, state):
        self.calls_in_eval += not state.training
        return state.outputs.float().sum() * 0 + 7.0


def test_compute_loss_is_training_only_and_evaluation_uses_cross_entropy(tmp_path):
    plugin = ConstantLoss()
    logits: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []

    def keep(state):
        logits.append(state.outputs.float())
        targets.append(state.batch[1])

    trainer = train(tmp_path, [plugin, Probe(eval_batch_end=keep)], max_duration="2ba")
    assert plugin.calls_in_eval == 0
    expected = F.cross_entropy(torch.cat(logits), torch.cat(targets)).item()
    assert trainer.state.eval_metrics["loss"] == pytest.approx(expected, rel=1e-5)
    assert trainer.state.eval_metrics["loss"] != pytest.approx(7.0)


def test_algorithms_given_as_a_string_are_names_and_a_class_is_told_to_be_an_instance(tmp_path):
    model = tiny_model()
    train_data, _ = tiny_loaders()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(model=model, optimizer=optimizer, train_data=train_data, algorithms="ema,label_smoothing",
                      max_duration="1ba", run_dir=tmp_path / "a", verbose=False)  # fmt: skip
    assert sorted(a.name for a in trainer.algorithms) == ["ema", "label_smoothing"]  # not "e", "m", "a"
    with pytest.raises(PluginError, match=r"^Probe is a class; pass an instance: Probe\(\)$"):
        train(tmp_path / "b", [Probe], max_duration="1ba")
    with pytest.raises(PluginError, match=r"^3 is not an Algorithm instance or an installed algorithm's name"):
        train(tmp_path / "c", [3], max_duration="1ba")
