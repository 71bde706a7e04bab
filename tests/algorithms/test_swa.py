"""SWA: the equal-weight average, its LR, the batch-norm pass, evaluation with the average,
the weights at the end, checkpoints and resume, options."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from slipstream_swa import SWA, anneal_lr, swa_update, update_bn

from helpers import Probe, tiny_model, train
from slipstream import ConfigError, Duration, SlipstreamError, State, load_checkpoint
from slipstream.plugins.discovery import discover, plugin_config

# tiny_loaders: 64 samples in batches of 16, 4 batches an epoch; runs of 2 epochs = 8 batches.
# Window [0.25dur, 0.625dur): updates at batch ends 2, 3, 4; the statistics pass on batches 6, 7, 8.
WINDOW = {"swa_start": "0.25dur", "swa_end": "0.625dur", "update_interval": "1ba"}
LR = {"swa_lr": 0.01, "anneal": "2ba"}


def swa(**options) -> SWA:
    return SWA(plugin_config(SWA, {**WINDOW, **options}))


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Recorder(Probe):
    """Live weights after each optimizer step, the inputs the model got."""

    name = "recorder"

    def __init__(self) -> None:
        super().__init__(
            after_optimizer_step=lambda s: self.after.append((s.timestamp.batch + 1, params(s.unwrapped_model))),
            before_forward=lambda s: self.inputs.append((s.timestamp.batch + 1, s.batch[0].clone())),
        )
        self.after: list[tuple[int, list[torch.Tensor]]] = []
        self.inputs: list[tuple[int, torch.Tensor]] = []


# -- the functions ------------------------------------------------------------------------


def test_swa_update_is_the_mean_and_copies_integers():
    avg = [torch.zeros(3), torch.tensor(0)]
    weights = [torch.randn(3) for _ in range(5)]
    for n, w in enumerate(weights):
        swa_update(avg, [w, torch.tensor(n + 7)], n)
    torch.testing.assert_close(avg[0], torch.stack(weights).mean(0))
    assert avg[1].item() == 11  # num_batches_tracked: the latest, not a mean
    with pytest.raises(ValueError, match="n_averaged"):
        swa_update(avg, [weights[0], torch.tensor(1)], -1)


def test_anneal_lr_linear_and_cosine():
    assert [anneal_lr(1.0, 0.2, p) for p in (-1, 0, 0.5, 1, 2)] == pytest.approx([1.0, 1.0, 0.6, 0.2, 0.2])
    assert anneal_lr(1.0, 0.0, 0.25, "cos") == pytest.approx((1 + math.cos(math.pi / 4)) / 2)
    with pytest.raises(ValueError, match="anneal_strategy"):
        anneal_lr(1.0, 0.0, 0.5, "cosine")


def test_update_bn_matches_torch_and_restores_mode_and_momentum():
    model = tiny_model().eval()
    batches = [torch.randn(4, 3, 16, 16) for _ in range(3)]
    mine, theirs = copy.deepcopy(model), copy.deepcopy(model)
    assert update_bn([(b, None) for b in batches], mine) == 3
    with torch.no_grad():
        torch.optim.swa_utils.update_bn(batches, theirs)
    for (k, a), b in zip(state(mine).items(), state(theirs).values(), strict=True):
        assert torch.equal(a, b), k
    assert not mine.training
    assert all(m.momentum == 0.1 for m in mine.modules() if isinstance(m, torch.nn.BatchNorm2d))


# -- in a run -----------------------------------------------------------------------------


def expected_final(rec: Recorder, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The mean of the weights after batches 2-4, with statistics recomputed on 6-8."""
    snaps = [p for b, p in rec.after if 2 <= b <= 4]
    assert len(snaps) == 3
    expected = copy.deepcopy(model)
    with torch.no_grad():
        for p, *ws in zip(expected.parameters(), *snaps, strict=True):
            p.copy_(torch.stack(ws).mean(0))
    assert update_bn([x for b, x in rec.inputs if b >= 6], expected) == 3
    return state(expected)


class EvalProbe(Probe):
    """At the evaluation of epoch 1 (batch 4, inside the window): whether the model holds
    the average or the live weights; after it, whether the live ones came back."""

    name = "eval_probe"

    def __init__(self, algo: SWA) -> None:
        super().__init__(epoch_end=self.snapshot, eval_batch_start=self.check, epoch_start=self.after_eval)
        self.algo, self.live, self.seen, self.restored = algo, None, [], []

    def snapshot(self, s):
        self.live = params(s.unwrapped_model)

    def check(self, s):
        if s.timestamp.batch == 4:
            now = params(s.unwrapped_model)
            self.seen.append((same(now, params(self.algo.swa_model)), same(now, self.live)))

    def after_eval(self, s):
        if s.timestamp.batch == 4:
            self.restored.append(same(params(s.unwrapped_model), self.live))


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def stepwise():
    cls = discover()["stepwise_lr"].cls
    return cls(plugin_config(cls, {"schedule": "warmup_cosine", "warmup": "0ba"}))


def test_the_average_is_evaluated_then_becomes_the_model_and_swa_lr_wins(tmp_path):
    algo, rec = swa(**LR), Recorder()
    evals = EvalProbe(algo)
    lrs: list[tuple[int, float]] = []
    lr_probe = Probe(after_optimizer_step=lambda s: lrs.append((s.timestamp.batch, s.optimizer.param_groups[0]["lr"])))
    trainer = train(tmp_path, [algo, stepwise(), rec, evals, lr_probe], max_duration="2ep", eval_interval="1ep")
    model = trainer.state.unwrapped_model
    # The end: the mean of the window's weights, batch-norm statistics of the 3 batches after it.
    for (key, got), want in zip(state(model).items(), expected_final(rec, model).values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=key)
    assert not same(params(model), rec.after[-1][1])  # not the last step's weights
    s = trainer.summary
    assert (s["swa"], s["swa_models"], s["swa_bn_batches"], s["swa_replaced"]) == (True, 3, 3, True)
    # Inside the window the evaluation saw the average, and the live weights came back.
    assert set(evals.seen) == {(True, False)} and evals.restored == [True]
    # stepwise_lr's cosine before the window; from it, annealed to swa_lr over 2 batches, held.
    lr_of = dict(lrs)
    schedule = [0.05 * (1 + math.cos(math.pi * b / 8)) / 2 for b in range(8)]
    assert [lr_of[b] for b in range(2)] == pytest.approx(schedule[:2])
    assert [lr_of[b] for b in range(2, 8)] == pytest.approx([schedule[2], (schedule[2] + 0.01) / 2] + [0.01] * 4)
    # latest.pt: the model is the average; no second set of weights to choose.
    final = load_checkpoint(trainer.run_dir / "checkpoints" / "latest.pt")["plugins"]["swa"]["state"]
    assert final["phase"] == "done" and "weights" not in final


def test_resume_in_the_window_and_in_the_statistics_pass_is_exact(tmp_path):
    straight = train(tmp_path / "straight", [swa(**LR)], max_duration="2ep", eval_interval=None,
                     checkpoint_interval="3ba", checkpoint_keep=-1)
    want = state(straight.state.unwrapped_model)
    for batch, phase, models, bn in ((3, "averaging", 2, 0), (6, "bn", 3, 1)):
        path = next((straight.run_dir / "checkpoints").glob(f"*-ba{batch}.pt"))
        saved = load_checkpoint(path)["plugins"]["swa"]
        assert saved["weights"] == "swa"
        kept = saved["state"]
        assert (kept["phase"], kept["n_averaged"], kept["bn_batches"]) == (phase, models, bn)
        resumed = train(tmp_path / f"from{batch}", [swa(**LR)], max_duration="2ep", eval_interval=None, load_path=path)
        got = state(resumed.state.unwrapped_model)
        assert all(torch.equal(got[k], want[k]) for k in want), batch
        assert resumed.summary["swa_models"] == 3 and resumed.summary["swa_bn_batches"] == 3


def test_off_before_the_end_the_model_keeps_its_weights_and_evaluates_them(tmp_path):
    """Stopped inside the window with eval_with_swa off: the evaluation saw the live
    weights, the model keeps them, and the checkpoint holds the average as weights `swa`."""

    def stop(s):
        if s.timestamp.batch == 5:
            s.request_stop("stopped_early", "test")

    algo, rec = swa(eval_with_swa=False), Recorder()
    evals = EvalProbe(algo)
    trainer = train(tmp_path, [algo, rec, evals, Probe(batch_end=stop)], max_duration="2ep", eval_interval="1ep")
    assert set(evals.seen) == {(False, True)}
    assert "swa" not in trainer.summary
    assert trainer.summary["swa_replaced"] is False and trainer.summary["swa_models"] == 3
    assert same(params(trainer.state.unwrapped_model), rec.after[-1][1])
    saved = load_checkpoint(trainer.run_dir / "checkpoints" / "latest.pt")
    weights = saved["plugins"]["swa"]["state"]["weights"]
    assert all(torch.equal(weights[k], v) for k, v in algo.swa_model.state_dict().items())
    assert any(not torch.equal(saved["model"][k], weights[k]) for k in weights)


# -- options and refusals -----------------------------------------------------------------


def test_bad_options_are_one_line():
    for bad, allowed in (({"swa_start": "1dur"}, "swa_start must be below 1dur"),
                         ({"swa_start": "0.8dur", "swa_end": "0.5dur"}, "swa_start must come before swa_end"),
                         ({"swa_end": "1.5dur"}, "swa_end: '1.5dur': a 'dur' duration is a fraction of the run"),
                         ({"swa_start": "10m"}, "swa_start must be a duration in ba, ep, sp or dur"),
                         ({"update_interval": "0.1dur"}, "update_interval must be a positive duration in ba or ep"),
                         ({"anneal_strategy": "cosine"}, "anneal_strategy"),
                         ({"swa_lr": -0.1}, "swa_lr"),
                         ({"bn_batches": 0}, "bn_batches"),
                         ({"swa_star": "0.5dur"}, "swa_star")):
        with pytest.raises(ConfigError) as error:
            plugin_config(SWA, bad)
        message = str(error.value)
        assert "\n" not in message and message.startswith("algorithms.swa") and allowed in message, message


def test_window_outside_the_run_and_ema_are_refused_by_name(tmp_path):
    model = tiny_model()
    run = State(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), max_duration=Duration.parse("2ep"))
    for options, match in (({"update_interval": "1ep"}, "update_interval: 1ep needs the batches per epoch"),
                           ({"swa_start": "8ep", "swa_end": "9ep"}, "swa_start: 8ep is not before the run's end"),
                           ({"swa_start": "1ep", "swa_end": "9ep"}, "swa_end: 9ep is past the run's end"),
                           ({"swa_start": "6ba", "swa_end": "1ep"}, "swa_start=6ba must come before swa_end=1ep")):
        with pytest.raises(ConfigError, match=match) as error:
            SWA(plugin_config(SWA, options)).init(run)
        assert "\n" not in str(error.value)
        run.batches_per_epoch = 4  # the others convert ep through it
    ema_cls = discover()["ema"].cls
    with pytest.raises(SlipstreamError, match="ema") as error:
        train(tmp_path / "e", [swa(), ema_cls(plugin_config(ema_cls, {}))], max_duration="1ba")
    assert "swa" in str(error.value) and "\n" not in str(error.value)
