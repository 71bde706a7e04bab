"""stepwise_lr: the schedule's math, and that the LR the optimizer uses follows it."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest
import torch
from slipstream_grad_accumulation import GradAccumulation, GradAccumulationConfig
from slipstream_stepwise_lr import SCHEDULES, StepwiseLR, StepwiseLRConfig, lr_at

from helpers import Probe, tiny_loaders, tiny_model, train
from slipstream import ConfigError, Trainer
from slipstream.plugins.discovery import plugin_config

BASE = 0.05  # helpers.train's LR
BATCHES_PER_EPOCH = 4  # helpers.tiny_loaders: 64 samples in batches of 16


class AfterLR(Probe):
    """Reads the LR at before_optimizer_step after stepwise_lr has set it."""

    runs_after = ("stepwise_lr", "grad_accumulation")


def lr_recorder() -> tuple[AfterLR, list[tuple[int, float]]]:
    seen: list[tuple[int, float]] = []
    probe = AfterLR(before_optimizer_step=lambda s: seen.append((s.timestamp.batch, s.optimizer.param_groups[0]["lr"])))
    return probe, seen


def linear_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 4))


def fit(tmp_path, algorithms, **kwargs):
    """helpers.train on a linear model without evaluation or interval checkpoints:
    the LR is what we watch, and it does not depend on the model."""
    kwargs.setdefault("model", linear_model())
    kwargs.setdefault("eval_interval", None)
    kwargs.setdefault("checkpoint_interval", None)
    return train(tmp_path, algorithms, **kwargs)


def algo(**options) -> StepwiseLR:
    return StepwiseLR(plugin_config(StepwiseLR, options))


# -- the pure function -------------------------------------------------------------


def torch_lrs(make_scheduler, steps: int) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=BASE)
    sched = make_scheduler(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize(
    "options, make_scheduler",
    [
        (
            {"schedule": "warmup_cosine", "warmup": "0ba", "min_lr": 0.001},
            lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=20, eta_min=0.001),
        ),
        (
            {"schedule": "step", "step_size": "3ba", "gamma": 0.5},
            lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
        ),
        (
            {"schedule": "multistep", "milestones": ["5ba", "0.6dur"], "gamma": 0.3},
            lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[5, 12], gamma=0.3),
        ),
        (
            {"schedule": "exponential", "step_size": "1ba", "gamma": 0.9},
            lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9),
        ),
        (
            {"schedule": "warmup_linear", "warmup": "20ba", "warmup_start_factor": 0.25},
            lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.25, total_iters=20),
        ),
    ],
)
def test_lr_at_matches_torch_schedulers_at_every_step(options, make_scheduler):
    cfg = StepwiseLRConfig(**options)
    ours = [lr_at(cfg, t, 20, BASE, unit="ba") for t in range(20)]
    assert ours == pytest.approx(torch_lrs(make_scheduler, 20), rel=1e-9)


def test_lr_at_shapes_of_warmup_and_onecycle():
    cos = {
        "schedule": "warmup_cosine",
        "warmup": "0.1dur",
        "warmup_start_factor": 0.1,
        "min_lr": 1e-4,
    }
    assert lr_at(cos, 0, 1, 1.0) == pytest.approx(0.1)
    assert lr_at(cos, 0.05, 1, 1.0) == pytest.approx(0.55)
    assert lr_at(cos, 0.1, 1, 1.0) == pytest.approx(1.0)
    assert lr_at(cos, 1.0, 1, 1.0) == pytest.approx(1e-4)
    values = [lr_at(cos, k / 100, 1, 1.0) for k in range(101)]
    peak = values.index(max(values))
    assert peak == 10 and all(a < b for a, b in pairwise(values[: peak + 1]))
    assert all(a > b for a, b in pairwise(values[peak:]))

    lin = {"schedule": "warmup_linear", "warmup": "2ep", "min_lr": 0.0}
    assert lr_at(lin, 6, 10, 1.0, unit="ep") == pytest.approx(0.5)  # halfway from 2ep to 10ep
    assert lr_at(lin, 10, 10, 1.0, unit="ep") == 0.0

    one = {"schedule": "onecycle", "pct_start": 0.25, "div_factor": 10, "final_div_factor": 100}
    assert lr_at(one, 0, 8, 1.0) == pytest.approx(0.1)
    assert lr_at(one, 2, 8, 1.0) == pytest.approx(1.0)
    assert lr_at(one, 8, 8, 1.0) == pytest.approx(0.001)
    assert lr_at(None, 0.5, 1, 2.0) == lr_at(StepwiseLRConfig(), 0.5, 1, 2.0)  # default config


def test_lr_at_refuses_a_duration_in_another_unit():
    with pytest.raises(ValueError, match=r"step_size=2ep .*'dur' or 'ba'"):
        lr_at({"schedule": "step", "step_size": "2ep"}, 3, 10, 0.1, unit="ba")
    with pytest.raises(ValueError, match="pass unit="):
        lr_at({"schedule": "step", "step_size": "2ep"}, 3, 10, 0.1)


# -- in the trainer -----------------------------------------------------------------


def test_lr_moves_inside_the_first_epoch_when_on_and_not_when_off(tmp_path):
    probe, on = lr_recorder()
    fit(tmp_path / "on", [algo(), probe], max_duration="2ep")
    first_epoch = [lr for batch, lr in on if batch < BATCHES_PER_EPOCH]
    assert len(set(first_epoch)) == BATCHES_PER_EPOCH  # a new LR every step

    probe, off = lr_recorder()
    fit(tmp_path / "off", [probe], max_duration="2ep")
    assert {lr for _, lr in off} == {BASE}


def test_warmup_rises_then_cosine_falls_to_min_lr(tmp_path):
    probe, seen = lr_recorder()
    sched = algo(schedule="warmup_cosine", warmup="4ba", warmup_start_factor=0.2, min_lr=0.001)
    fit(tmp_path, [sched, probe], max_duration="4ep")
    lrs = [lr for _, lr in seen]
    assert len(lrs) == 16
    assert lrs[0] == pytest.approx(0.2 * BASE)
    assert all(a < b for a, b in pairwise(lrs[:5])) and lrs[4] == pytest.approx(BASE)
    assert all(a > b for a, b in pairwise(lrs[4:]))
    # The last step is at 15/16 of the run; at 16/16 the LR is min_lr exactly.
    assert lrs[-1] == pytest.approx(lr_at(sched.config, 15, 16, BASE, unit="ba"))
    assert lrs[-1] < 0.002
    assert lr_at(sched.config, 16, 16, BASE, unit="ba") == pytest.approx(0.001)


def test_interval_epoch_changes_the_lr_only_at_epoch_boundaries(tmp_path):
    probe, seen = lr_recorder()
    fit(
        tmp_path,
        [algo(schedule="warmup_linear", warmup="0dur", interval="epoch"), probe],
        max_duration="4ep",
    )
    per_epoch = [{lr for batch, lr in seen if batch // BATCHES_PER_EPOCH == e} for e in range(4)]
    assert all(len(lrs) == 1 for lrs in per_epoch)
    # Evaluated at each epoch's start: 0, 1/4, 2/4, 3/4 of a linear decay.
    assert [lrs.pop() for lrs in per_epoch] == pytest.approx([BASE, 0.75 * BASE, 0.5 * BASE, 0.25 * BASE])


def test_logged_lr_is_the_lr_the_optimizer_used(tmp_path):
    probe, seen = lr_recorder()
    trainer = fit(tmp_path, [algo(), probe], max_duration="2ep", log_interval=1)
    logged = {}
    for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            logged[record["step"]] = record["lr"]
    # A step taken during batch b is logged as step b + 1 (at that batch's end).
    assert {batch + 1: lr for batch, lr in seen} == logged
    assert len(set(logged.values())) == len(logged)


def test_wall_clock_run_moves_the_lr_over_the_budget(tmp_path):
    probe, seen = lr_recorder()
    fit(tmp_path, [algo(schedule="warmup_linear", warmup="0.2dur"), probe], max_duration="2s")
    lrs = [lr for _, lr in seen]
    assert len(lrs) > 6
    peak = lrs.index(max(lrs))
    assert 0 < peak < len(lrs) - 1 and max(lrs) > 0.8 * BASE
    # From near the warm-up's start to near zero at the end of the budget.
    assert lrs[0] < 0.5 * BASE and lrs[-1] < 0.2 * BASE


def test_wall_clock_run_refuses_an_epoch_duration(tmp_path):
    with pytest.raises(ConfigError, match=r"stepwise_lr\.step_size: .*write it in 'dur' or in the run's unit"):
        fit(tmp_path, [algo(schedule="step", step_size="1ep")], max_duration="1s")


def test_schedule_in_ba_counts_loop_batches_under_accumulation(tmp_path):
    probe, seen = lr_recorder()
    accumulate = GradAccumulation(GradAccumulationConfig(steps=2))
    sched = algo(schedule="step", step_size="4ba", gamma=0.5)
    fit(tmp_path, [accumulate, sched, probe], max_duration="4ep")
    # Steps happen on every second batch; the LR halves every 4 loop batches,
    # i.e. every 2 optimizer steps.
    assert [batch for batch, _ in seen] == list(range(1, 16, 2))
    assert [lr for _, lr in seen] == pytest.approx([BASE * 0.5 ** (b // 4) for b in range(1, 16, 2)])


def test_each_param_group_is_scaled_from_its_own_lr(tmp_path):
    model = tiny_model()
    head = list(model.get_classifier().parameters())
    head_ids = {id(p) for p in head}
    body = [p for p in model.parameters() if id(p) not in head_ids]
    optimizer = torch.optim.SGD([{"params": body, "lr": 0.1}, {"params": head, "lr": 0.01}], lr=0.1)
    seen: list[tuple[float, float]] = []
    probe = AfterLR(before_optimizer_step=lambda s: seen.append(tuple(g["lr"] for g in s.optimizer.param_groups)))
    train_data, _ = tiny_loaders()
    Trainer(
        model=model,
        optimizer=optimizer,
        train_data=train_data,
        max_duration="2ep",
        eval_interval=None,
        algorithms=[algo(), probe],
        run_dir=tmp_path / "run",
        device="cpu",
        progress_bar=False,
        verbose=False,
    ).fit()
    assert len(seen) == 8
    for body_lr, head_lr in seen:
        assert head_lr == pytest.approx(body_lr / 10)


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_resume_gives_the_same_lr_sequence(tmp_path, interval):
    options = {"schedule": "warmup_cosine", "warmup": "0.3dur", "interval": interval}
    probe, full = lr_recorder()
    fit(tmp_path / "full", [algo(**options), probe], max_duration="4ep")

    def stop_mid_epoch(state):
        if state.timestamp.batch == 6:  # inside the second epoch
            state.stop_requested = True

    probe, first = lr_recorder()
    probe.callbacks["batch_end"] = stop_mid_epoch
    trainer = fit(
        tmp_path / "resume", [algo(**options), probe], max_duration="4ep", checkpoint_interval="4ep"
    )
    checkpoint = trainer.run_dir / "checkpoints" / "latest.pt"
    assert trainer.state.timestamp.batch == 6

    probe, second = lr_recorder()
    # The resumed optimizer starts at the checkpoint's (scheduled) LR; the base LRs
    # come from the plugin's state.
    fit(tmp_path / "resume", [algo(**options), probe], max_duration="4ep", load_path=checkpoint)
    assert [b for b, _ in first + second] == [b for b, _ in full] == list(range(16))
    assert [lr for _, lr in first + second] == pytest.approx([lr for _, lr in full], rel=1e-12)


def test_state_dict_round_trip():
    a = algo(interval="epoch")
    a.base_lrs, a._epoch_t = [0.1, 0.02], 1.0
    b = algo(interval="epoch")
    b.load_state_dict(a.state_dict())
    assert (b.base_lrs, b._epoch_t) == ([0.1, 0.02], 1.0)


# -- config and discovery -------------------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        ({"schedule": "cosine_restarts"}, "schedule must be one of " + ", ".join(SCHEDULES)),
        ({"interval": "batch"}, "interval must be one of step, epoch"),
        ({"warmup": "5 weeks"}, "warmup: '5 weeks' is not a duration"),
        ({"warmup": "2dur"}, "warmup: '2dur'.*from 0 to 1"),
        ({"step_size": "0ep"}, "step_size must be a positive duration"),
        ({"milestones": ["3ep", "later"]}, "milestones: 'later' is not a duration"),
        ({"gamma": 0.0}, "gamma must be a finite number > 0"),
        ({"pct_start": 1.0}, r"pct_start must be a finite number in \(0, 1\)"),
        ({"warmup_start_factor": 1.5}, r"warmup_start_factor must be a finite number in \[0, 1\]"),
        ({"min_lr": -1.0}, "min_lr must be a finite number >= 0"),
    ],
)
def test_config_errors_name_the_key_and_what_is_allowed(options, message):
    with pytest.raises(ConfigError, match=f"algorithms.stepwise_lr: {message}"):
        plugin_config(StepwiseLR, options)
