"""The hook contract: firing order, step wrapping and replacing, binding."""

import itertools
import json

import pytest
import torch

from helpers import Probe, tiny_loaders, tiny_model, train
from slipstream import NOT_MINE, Algorithm, PluginError, hookimpl, hookspecs
from slipstream.hookspecs import EVENTS, STEPS

BATCH_EVENTS = [
    "batch_start",
    "before_forward",
    "after_forward",
    "after_loss",
    "before_backward",
    "after_backward",
    "before_optimizer_step",
    "after_optimizer_step",
    "batch_end",
]
EVAL_EVENTS = lambda n: ["eval_start", *(["eval_batch_start", "eval_batch_end"] * n), "eval_end"]  # noqa: E731


def test_exact_firing_order_for_a_full_short_run(tmp_path):
    probe = Probe()
    # 64 samples / 16 per batch = 4 batches per epoch; evaluation every epoch (4 eval batches).
    train(tmp_path, [probe], max_duration="2ep")
    epoch = ["epoch_start", *BATCH_EVENTS * 4, "epoch_end", *EVAL_EVENTS(4)]
    assert probe.events == ["init", "fit_start", *epoch, *epoch, "fit_end"]


def test_final_evaluation_precedes_fit_end_when_the_run_ends_mid_epoch(tmp_path):
    probe = Probe()
    train(tmp_path, [probe], max_duration="3ba")
    assert probe.events == [
        "init",
        "fit_start",
        "epoch_start",
        *BATCH_EVENTS * 3,
        *EVAL_EVENTS(4),
        "fit_end",
    ]


def test_the_event_and_step_lists_are_the_contract():
    import slipstream.hookspecs as specs

    # Both ways: a hookspec missing from the lists would never be bound by the loop,
    # and a listed name without a hookspec would be no hook at all.
    specified = {name for name, obj in vars(specs).items() if hasattr(obj, "slipstream_spec")}
    assert specified == {*EVENTS, *STEPS}
    assert len(EVENTS) + len(STEPS) == len(specified)  # no name listed twice
    for name in STEPS:
        assert getattr(specs, name).slipstream_spec["firstresult"], name
    for name in EVENTS:
        assert not getattr(specs, name).slipstream_spec["firstresult"], name


class Wrap(Algorithm):
    name = "wrap"

    def __init__(self, log):
        super().__init__()
        self.log = log

    @hookimpl(wrapper=True)
    def forward(self, state):
        self.log.append("wrap:before")
        result = yield
        self.log.append("wrap:after")
        return result * 0 + 1.0  # a wrapper may change the result


class Outer(Wrap):
    name = "outer"
    runs_before = ("wrap",)

    @hookimpl(wrapper=True)
    def forward(self, state):
        self.log.append("outer:before")
        result = yield
        self.log.append("outer:after")
        return result


def test_wrappers_compose_in_the_resolved_order(tmp_path):
    log = []
    seen = []
    probe = Probe(after_forward=lambda s: seen.append(s.outputs.detach().clone()))
    train(tmp_path, [Wrap(log), Outer(log), probe], max_duration="1ba", eval_interval=None)
    assert log[:4] == ["outer:before", "wrap:before", "wrap:after", "outer:after"]
    assert torch.all(seen[0] == 1.0)


class ReplaceLoss(Algorithm):
    name = "replace_loss"

    @hookimpl
    def compute_loss(self, state):
        return state.outputs.float().pow(2).mean()


class ReplaceLossToo(ReplaceLoss):
    name = "replace_loss_too"


def test_a_plugin_replaces_a_step(tmp_path):
    losses = []
    probe = Probe(
        after_loss=lambda s: losses.append((s.loss.item(), s.outputs.float().pow(2).mean().item()))
    )
    train(tmp_path, [ReplaceLoss(), probe], max_duration="2ba", eval_interval=None)
    assert all(a == pytest.approx(b) for a, b in losses)


def test_two_plugins_replacing_one_step_is_an_error_naming_both(tmp_path):
    with pytest.raises(
        PluginError,
        match=r"'replace_loss'.*'replace_loss_too'.*compute_loss|'replace_loss_too'.*'replace_loss'.*compute_loss",
    ):
        train(tmp_path, [ReplaceLoss(), ReplaceLossToo()], max_duration="1ba")


class SkipEveryOther(Algorithm):
    name = "skip_every_other"

    @hookimpl
    def should_step(self, state):
        return state.timestamp.batch % 2 == 1


def test_should_step_gates_the_optimizer_and_its_events(tmp_path):
    probe = Probe()
    trainer = train(tmp_path, [SkipEveryOther(), probe], max_duration="4ba", eval_interval=None)
    assert probe.events.count("before_optimizer_step") == 2
    assert probe.events.count("after_optimizer_step") == 2
    assert trainer.state.timestamp.optimizer_steps == 2


def test_unimplemented_hooks_are_skipped_or_do_nothing(tmp_path):
    # No plugin implements any hook: the events change nothing and every step is the
    # engine's default (forward, cross-entropy, backward, a step each batch), so a run
    # ends with the weights of a hand-written loop over the same batches.
    trainer = train(tmp_path, [], max_duration="3ba", eval_interval=None)
    assert trainer.state.timestamp.optimizer_steps == 3
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in itertools.islice(tiny_loaders()[0], 3):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    for ours, theirs in zip(trainer.state.model.state_dict().values(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(ours, theirs)


def test_every_per_batch_event_reaches_a_plugin_that_implements_it(tmp_path):
    probe = Probe()
    trainer = train(tmp_path, [probe], max_duration="2ba", eval_interval=None)
    assert hookspecs.BATCH_EVENTS == tuple(BATCH_EVENTS)  # the ones the loop may skip
    for name in BATCH_EVENTS:
        assert trainer.hooks.__dict__[name] is not None, name
        assert probe.events.count(name) == 2, name


class Boom(Algorithm):
    name = "boom"

    def __init__(self):
        super().__init__()
        self.seen = None

    @hookimpl
    def after_backward(self, state):
        raise RuntimeError("boom")

    @hookimpl
    def exception(self, state, error):
        self.seen = error


def test_exception_event_fires_and_the_error_propagates(tmp_path):
    boom = Boom()
    with pytest.raises(RuntimeError, match="boom"):
        train(tmp_path, [boom], max_duration="2ba")
    assert isinstance(boom.seen, RuntimeError)
    import json

    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "boom" in summary["error"]


def test_state_says_where_the_batch_is(tmp_path):
    seen = {}

    def at(name):
        return lambda s: seen.setdefault(
            name, (s.batch[0].device.type, tuple(s.batch[0].shape), s.training)
        )

    probe = Probe(batch_start=at("batch_start"), eval_batch_start=at("eval_batch_start"))
    train(tmp_path, [probe], max_duration="1ba")
    assert seen["batch_start"] == ("cpu", (16, 3, 16, 16), True)
    assert seen["eval_batch_start"][2] is False


def test_train_throughput_leaves_evaluation_time_out(tmp_path, monkeypatch):
    # A fake clock: every training batch takes 1 s and every evaluation 100 s, so each
    # record of 3 batches x 16 samples must read 16 samples/s, also those whose interval
    # holds an evaluation (4 batches per epoch: evaluations fall inside intervals).
    from types import SimpleNamespace

    from slipstream import state as state_module

    # Rates are per second of the run's clock (State.tick), which reads this.
    now = [0.0]
    monkeypatch.setattr(state_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def advance(seconds: float):
        def hook(state):
            now[0] += seconds

        return hook

    probe = Probe(batch_start=advance(1.0), eval_batch_start=advance(100.0 / 4))
    trainer = train(tmp_path, [probe], max_duration="3ep", log_interval=3, eval_interval="1ep")
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_s"] for r in records if r["kind"] == "train"]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [4, 8, 12]
    # Every log_interval, and before each evaluation for the steps up to it.
    assert [r["step"] for r in records if r["kind"] == "train"] == [3, 4, 6, 8, 9, 12]
    assert rates == pytest.approx([16.0] * 6)


class LossRecorder(Algorithm):
    name = "loss_recorder"

    def __init__(self):
        super().__init__()
        self.losses: list[float] = []

    @hookimpl
    def after_loss(self, state):
        self.losses.append(float(state.loss))


@pytest.mark.parametrize("fold", [256, 2])
def test_the_logged_loss_is_the_mean_of_the_intervals_batches(tmp_path, monkeypatch, fold):
    # fold=2 makes the keeper stack its losses every 2 batches inside a 5-batch interval.
    import slipstream.services.losses as losses

    monkeypatch.setattr(losses, "FOLD", fold)
    recorder = LossRecorder()
    trainer = train(tmp_path, [recorder], max_duration="12ba", log_interval=5, eval_interval=None)
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    assert [step for step, _ in logged] == [5, 10, 12]
    starts = [0, 5, 10]
    for (step, loss), start in zip(logged, starts, strict=True):
        expected = sum(recorder.losses[start:step]) / (step - start)
        assert loss == pytest.approx(expected, rel=1e-6)


class ForgetsToReturn(Algorithm):
    name = "forgets_to_return"

    def __init__(self):
        super().__init__()
        self.calls = 0

    @hookimpl
    def backward(self, state):
        self.calls += 1
        state.loss.backward()  # and no return: the engine's default would backward again


class BackwardSometimes(Algorithm):
    """Replaces backward on odd batches only, leaving even ones to the engine."""

    name = "backward_sometimes"

    def __init__(self):
        super().__init__()
        self.mine = []

    @hookimpl
    def backward(self, state):
        if state.timestamp.batch % 2 == 0:
            return NOT_MINE
        self.mine.append(state.timestamp.batch)
        (state.loss * 0).backward()  # no gradient: the weights must not move on odd batches
        return True


def test_a_replacing_step_that_returns_none_is_an_error_naming_the_plugin(tmp_path):
    plugin = ForgetsToReturn()
    with pytest.raises(PluginError, match=r"'forgets_to_return'.*'backward'.*None.*NOT_MINE"):
        train(tmp_path, [plugin], max_duration="2ba", eval_interval=None)
    assert plugin.calls == 1  # stopped at its first call, before a second backward


class ScalesTheLoss(Algorithm):
    """Wraps compute_loss; ``forget`` drops the result (no ``return``)."""

    name = "scales_loss"

    def __init__(self, forget: bool):
        super().__init__()
        self.forget = forget
        self.losses = []

    @hookimpl(wrapper=True)
    def compute_loss(self, state):
        loss = yield
        if self.forget:
            loss = loss * 2  # and no return
        else:
            self.losses.append(loss.item())
            return loss * 2


def test_a_step_wrapper_that_returns_none_is_an_error_naming_the_plugin(tmp_path):
    with pytest.raises(PluginError, match=r"^plugin 'scales_loss' wraps the 'compute_loss' step but returned None"):
        train(tmp_path / "a", [ScalesTheLoss(forget=True)], max_duration="2ba", eval_interval=None)
    # Returning the result: the loop gets what the wrapper made of it.
    plugin, kept = ScalesTheLoss(forget=False), []
    probe = Probe(after_loss=lambda s: kept.append(s.loss.item()))
    train(tmp_path / "b", [plugin, probe], max_duration="2ba", eval_interval=None)
    assert kept == pytest.approx([2 * loss for loss in plugin.losses])


def test_not_mine_leaves_the_step_to_the_engine(tmp_path):
    plugin = BackwardSometimes()
    moved = []
    probe = Probe(
        before_optimizer_step=lambda s: moved.append(
            any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in s.model.parameters())
        )
    )
    train(tmp_path, [plugin, probe], max_duration="4ba", eval_interval=None)
    assert plugin.mine == [1, 3]
    assert moved == [True, False, True, False]  # the engine's backward on even batches only
