"""EMA: the averaged weights, evaluation with them, half-life conversion, checkpoints."""

from __future__ import annotations

import pytest
import torch
from slipstream_ema import EMA, EMAConfig, ema_update, half_life_decay

from helpers import Probe, tiny_loaders, tiny_model, train
from slipstream import Algorithm, ConfigError, Duration, State, Trainer, hookimpl
from slipstream.plugins.discovery import plugin_config


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def ema(**options) -> EMA:
    return EMA(plugin_config(EMA, options))


# -- the pure functions ---------------------------------------------------------------


def test_ema_update_interpolates_floats_and_copies_integers():
    ema_list = [torch.zeros(3), torch.full((2,), 4.0, dtype=torch.float64), torch.tensor(1)]
    live = [torch.ones(3), torch.zeros(2, dtype=torch.float64), torch.tensor(7)]
    ema_update(ema_list, live, 0.75)
    assert torch.allclose(ema_list[0], torch.full((3,), 0.25))
    assert torch.allclose(ema_list[1], torch.full((2,), 3.0, dtype=torch.float64))
    assert ema_list[2].item() == 7  # num_batches_tracked is copied, not averaged
    assert live[0].eq(1).all()  # the live tensors are untouched
    with pytest.raises(ValueError, match="decay"):
        ema_update(ema_list, live, 1.5)


def test_half_life_decay():
    assert half_life_decay(10) == pytest.approx(0.5 ** 0.1)
    assert half_life_decay(10, elapsed=10) == pytest.approx(0.5)
    assert half_life_decay(4, elapsed=2) ** 2 == pytest.approx(0.5)


# -- the average during training --------------------------------------------------------


def analytic_ema(snapshots, decay, every=1, start_batches=None):
    """What the EMA must be after the scripted sequence of live weights:
    ``snapshots[i]`` are the weights after optimizer step i + 1 (no accumulation)."""
    average, last = None, 0
    for step, weights in enumerate(snapshots, start=1):
        copying = start_batches is not None and step - 1 < start_batches
        if not copying and step - last < every:
            continue
        if copying or average is None:
            average = [w.clone() for w in weights]
        else:
            d = decay ** (step - last)
            average = [d * a + (1 - d) * w for a, w in zip(average, weights, strict=True)]
        last = step
    return average


@pytest.mark.parametrize(
    "options, every, start",
    [({"decay": 0.8}, 1, None), ({"decay": 0.7, "update_every": 2, "start": "3ba"}, 2, 3)],
)
def test_ema_equals_the_analytic_average_and_lags_the_weights(tmp_path, options, every, start):
    snapshots = []
    probe = Probe(after_optimizer_step=lambda s: snapshots.append(params(s.unwrapped_model)))
    algo = ema(**options)
    trainer = train(tmp_path, [algo, probe], max_duration="8ba", eval_interval=None)

    live = params(trainer.state.unwrapped_model)
    averaged = params(algo.ema_model)
    assert len(snapshots) == 8 and same(live, snapshots[-1])  # the model keeps its live weights
    assert not any(torch.allclose(a, w) for a, w in zip(averaged, live, strict=True))  # lags
    expected = analytic_ema(snapshots, options["decay"], every, start)
    for a, e in zip(averaged, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


def test_batchnorm_statistics_are_averaged_or_copied(tmp_path):
    averaged, copied = ema(decay=0.9), ema(decay=0.9, average_buffers=False)
    for algo, folder in ((averaged, "avg"), (copied, "copy")):
        trainer = train(tmp_path / folder, [algo], max_duration="3ba", eval_interval=None)
        live = dict(trainer.state.unwrapped_model.named_buffers())
        mine = dict(algo.ema_model.named_buffers())
        key = next(k for k in live if k.endswith("running_mean"))
        assert torch.equal(mine[key], live[key]) is (algo is copied)


# -- evaluation -------------------------------------------------------------------------


class EvalProbe(Probe):
    """Snapshots the live weights just before evaluation and compares at each eval batch."""

    def __init__(self, algo: EMA) -> None:
        super().__init__(
            epoch_end=self.snapshot,
            eval_batch_start=self.check,
            epoch_start=self.after_eval,
            fit_end=self.after_eval,
        )
        self.algo = algo
        self.before: list[torch.Tensor] | None = None
        self.seen: list[tuple[bool, bool]] = []  # (model == EMA, model == live) per eval batch
        self.restored: list[bool] = []

    def snapshot(self, state):
        self.before = params(state.unwrapped_model)

    def check(self, state):
        now = params(state.unwrapped_model)
        self.seen.append((same(now, params(self.algo.ema_model)), same(now, self.before)))

    def after_eval(self, state):
        if self.before is not None:
            self.restored.append(same(params(state.unwrapped_model), self.before))


@pytest.mark.parametrize("with_ema", [True, False])
def test_evaluation_uses_the_ema_weights_then_restores_the_live_ones(tmp_path, with_ema):
    algo = ema(decay=0.9, eval_with_ema=with_ema)
    probe = EvalProbe(algo)
    trainer = train(tmp_path, [algo, probe], max_duration="2ep")

    assert probe.seen and all(seen == (with_ema, not with_ema) for seen in probe.seen)
    assert probe.restored and all(probe.restored)  # after each evaluation (epoch 1 and final)
    assert trainer.summary.get("ema") is (True if with_ema else None)
    assert trainer.summary.get("ema_decay") == (0.9 if with_ema else None)


def test_a_failed_evaluation_leaves_the_live_weights(tmp_path):
    algo = ema(decay=0.9)
    before = {}

    def fail(state):
        assert same(params(state.unwrapped_model), params(algo.ema_model))
        raise RuntimeError("eval crashed")

    probe = Probe(
        epoch_end=lambda s: before.update(w=params(s.unwrapped_model)), eval_batch_start=fail
    )
    model = tiny_model()
    with pytest.raises(RuntimeError, match="eval crashed"):
        train(tmp_path, [algo, probe], model=model, max_duration="2ep")
    assert same(params(model), before["w"])


# -- half-life -------------------------------------------------------------------------------


def bare_state(max_duration: str, batches_per_epoch: int | None = 4, batch_size: int = 16) -> State:
    model = torch.nn.Linear(2, 2)
    return State(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        max_duration=Duration.parse(max_duration),
        batches_per_epoch=batches_per_epoch,
        global_batch_size=batch_size,
    )


@pytest.mark.parametrize(
    "half_life, run, batches",
    [("50ba", "10ep", 50), ("0.5ep", "10ep", 2), ("0.1dur", "10ep", 4), ("0.25dur", "100ba", 25),
     ("64sp", "10ep", 4), ("3ep", "1000ba", 12)],
)
def test_half_life_converts_to_batches(half_life, run, batches):
    algo = ema(half_life=half_life)
    algo.init(bare_state(run))
    assert algo.half_life_batches == pytest.approx(batches)


def test_half_life_needs_a_run_it_can_count_in_batches():
    algo = ema(half_life="0.1dur")
    with pytest.raises(ConfigError, match="half_life.*write it in ba"):
        algo.init(bare_state("60s", batches_per_epoch=None))


class EveryOtherBatch(Algorithm):
    """Gradient accumulation over two batches (the step part of it)."""

    name = "every_other_batch"

    @hookimpl
    def should_step(self, state):
        return state.timestamp.batch % 2 == 1


@pytest.mark.parametrize("accumulate", [False, True])
def test_half_life_is_counted_in_optimizer_steps_under_accumulation(tmp_path, accumulate):
    algo = ema(half_life="4ba")
    extra = [EveryOtherBatch()] if accumulate else []
    trainer = train(tmp_path, [algo, *extra], max_duration="8ba", eval_interval=None)
    steps = trainer.state.timestamp.optimizer_steps
    assert steps == (4 if accumulate else 8)
    # Each optimizer step covers 2 batches (or 1): the decay per step follows.
    assert algo.last_decay == pytest.approx(0.5 ** ((2 if accumulate else 1) / 4))


# -- checkpoints -------------------------------------------------------------------------------


def test_ema_state_survives_a_checkpoint_resume(tmp_path):
    first = ema(decay=0.9)
    run = train(tmp_path, [first], max_duration="1ep", eval_interval=None)
    latest = run.run_dir / "checkpoints" / "latest.pt"
    saved = torch.load(latest, weights_only=True)["plugins"]["ema"]["state"]
    assert saved["n_averaged"] == 4 and saved["last_step"] == 4
    saved_weights = [saved["weights"][k] for k, _ in first.ema_model.named_parameters()]
    assert same(saved_weights, params(first.ema_model))

    # Resume to 2ep; at fit_start the EMA is the saved one, not a copy of the model.
    resumed, at_start = ema(decay=0.9), {}
    probe = Probe(
        fit_start=lambda s: at_start.update(
            ema=params(resumed.ema_model), live=params(s.unwrapped_model)
        )
    )
    train(tmp_path, [resumed, probe], max_duration="2ep", eval_interval=None, load_path=latest)
    assert same(at_start["ema"], saved_weights) and not same(at_start["ema"], at_start["live"])

    # And the resumed run ends where an uninterrupted one does.
    straight = ema(decay=0.9)
    train(tmp_path / "straight", [straight], max_duration="2ep", eval_interval=None)
    for a, b in zip(params(resumed.ema_model), params(straight.ema_model), strict=True):
        torch.testing.assert_close(a, b)
    assert resumed.state_dict()["last_step"] == straight.state_dict()["last_step"] == 8


def test_state_is_loaded_after_init_as_the_contract_says():
    # The engine calls load_state_dict after init (slipstream.hookspecs); before it,
    # there is no averaged copy to load into, and the error says so.
    source = ema(decay=0.5)
    source.init(bare_state("10ep"))
    for p in source.ema_model.parameters():
        p.data.fill_(3.0)
    with pytest.raises(RuntimeError, match="init"):
        ema(decay=0.5).load_state_dict(source.state_dict())
    target = ema(decay=0.5)
    target.init(bare_state("10ep"))
    target.load_state_dict(source.state_dict())
    assert all(p.eq(3.0).all() for p in target.ema_model.parameters())


# -- config -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        ({"decay": 0.99, "half_life": "50ba"}, "only one of decay and half_life"),
        ({"decay": 1.0}, r"decay must be a finite number in \(0, 1\)"),
        ({"decay": 0.0}, r"decay must be a finite number in \(0, 1\)"),
        ({"decay": -0.5}, r"decay must be a finite number in \(0, 1\)"),
        ({"half_life": "fifty"}, "half_life.*not a duration"),
        ({"half_life": "10m"}, "half_life must be a positive duration in ba, ep, sp or dur"),
        ({"half_life": "0ba"}, "half_life must be a positive duration"),
        ({"start": "soon"}, "start.*not a duration"),
        ({"update_every": 0}, "update_every must be a whole number >= 1"),
        ({"decay": "high"}, "algorithms.ema.decay"),
    ],
)
def test_config_errors_name_the_key_and_what_is_allowed(options, message):
    with pytest.raises(ConfigError, match=message) as info:
        plugin_config(EMA, options)
    assert "algorithms.ema" in str(info.value)


def test_defaults():
    algo = EMA()
    assert algo.decay == 0.999 and algo.config == EMAConfig()
    assert ema(half_life="10ba").decay is None


def test_runs_in_its_declared_place(tmp_path):
    assert EMA.runs_after == ("locality_ffn", "channels_last", "fsdp")  # fsdp: average the shards
    assert "torch_compile" in EMA.runs_before
    train_data, _ = tiny_loaders()
    model = tiny_model()

    class TorchCompile(Algorithm):
        name = "torch_compile"

    trainer = Trainer(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), train_data=train_data,
        algorithms=[TorchCompile(), EMA()], device="cpu", run_dir=tmp_path, verbose=False,
    )
    assert [a.name for a in trainer.algorithms] == ["ema", "torch_compile"]
