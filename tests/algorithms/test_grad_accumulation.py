"""grad_accumulation: steps every N batches, gradients of the big batch, no all-reduce
in between, the logged loss untouched, and resumes mid-group."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from slipstream_grad_accumulation import (
    AccumulationPlan,
    GradAccumulation,
    GradAccumulationConfig,
    _find_ddp,
    accumulation_plan,
)

from helpers import Probe, tiny_loaders, tiny_model
from slipstream import Algorithm, ConfigError, Trainer, hookimpl
from slipstream.plugins.discovery import plugin_config


class RecordingBackward(Algorithm):
    """Replaces the backward step, as mixed precision's GradScaler does, and records
    the loss it is given and whether DDP would all-reduce."""

    name = "recording_backward"

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, float, bool | None]] = []

    @hookimpl
    def backward(self, state):
        sync = getattr(state.model, "require_backward_grad_sync", None)
        self.seen.append((state.timestamp.batch, state.loss.item(), sync))
        state.loss.backward()
        return True


class Recorder(Probe):
    """Records losses, step batches and gradients; runs after the plugin."""

    runs_after = ("grad_accumulation",)

    def __init__(self, stop_at: int | None = None) -> None:
        super().__init__(
            batch_end=lambda s: setattr(s, "stop_requested", s.timestamp.batch == stop_at),
            after_loss=lambda s: self.losses.append(s.loss.item()),
            after_backward=lambda s: self.backward_losses.append(s.loss.item()),
            before_optimizer_step=self._grads,
            after_optimizer_step=lambda s: self.steps.append(s.timestamp.batch),
        )
        self.losses: list[float] = []
        self.backward_losses: list[float] = []
        self.steps: list[int] = []
        self.grads: list[list[torch.Tensor]] = []

    def _grads(self, state) -> None:
        self.grads.append([p.grad.clone() for p in state.unwrapped_model.parameters()])


def loss_factors(backward: RecordingBackward, recorder: Recorder) -> list[float]:
    """What each batch's loss was multiplied by before its backward pass."""
    return [seen / loss for (_, seen, _), loss in zip(backward.seen, recorder.losses, strict=True)]


def linear_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 4))


def fit(tmp_path, algorithms, *, batch_size=4, model=None, max_duration="1ep", lr=0.05, **kwargs) -> Trainer:
    """Train on the 64 samples of helpers.tiny_loaders in batches of ``batch_size``."""
    train_data, eval_data = tiny_loaders(batch_size=batch_size)
    model = model if model is not None else linear_model()
    kwargs.setdefault("eval_interval", None)
    kwargs.setdefault("checkpoint_interval", None)
    trainer = Trainer(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
        train_data=train_data,
        eval_data=eval_data,
        max_duration=max_duration,
        algorithms=algorithms,
        run_dir=kwargs.pop("run_dir", tmp_path / "run"),
        device="cpu",
        progress_bar=False,
        verbose=False,
        **kwargs,
    )
    trainer.fit()
    return trainer


def accumulate(steps: int) -> GradAccumulation:
    return GradAccumulation(plugin_config(GradAccumulation, {"steps": steps}))


# -- the pure function ----------------------------------------------------------------


def test_accumulation_plan():
    assert [accumulation_plan(p, 4) for p in range(5)] == [
        AccumulationPlan(4, False),
        AccumulationPlan(4, False),
        AccumulationPlan(4, False),
        AccumulationPlan(4, True),
        AccumulationPlan(4, False),
    ]
    # A group cut short by the end of the epoch (2 batches left at position 4) is
    # averaged over its own 2 batches.
    assert [accumulation_plan(p, 4, batches_left=6 - p) for p in range(4, 6)] == [
        AccumulationPlan(2, False),
        AccumulationPlan(2, True),
    ]
    assert accumulation_plan(1, 3, batches_left=1) == AccumulationPlan(2, True)
    assert all(accumulation_plan(p, 1) == AccumulationPlan(1, True) for p in range(3))
    with pytest.raises(ValueError, match="steps must be >= 1"):
        accumulation_plan(0, 0)


# -- in the trainer -------------------------------------------------------------------


def test_optimizer_steps_once_every_n_batches(tmp_path):
    on, off = Recorder(), Recorder()
    trainer = fit(tmp_path / "on", [accumulate(4), on], max_duration="2ep")
    assert on.steps == list(range(3, 32, 4))  # the index of the batch that stepped
    assert trainer.summary["optimizer_steps"] == 8 and trainer.summary["batches"] == 32
    assert trainer.summary["effective_batch_size"] == 16
    fit(tmp_path / "off", [off], max_duration="2ep")
    assert off.steps == list(range(32))


@pytest.mark.parametrize("kind", ["linear", "vit"])
def test_gradients_equal_those_of_one_batch_n_times_bigger(tmp_path, kind):
    def model():
        return linear_model() if kind == "linear" else tiny_model("vit")

    small, big = Recorder(), Recorder()
    small_run = fit(tmp_path / "small", [accumulate(4), small], batch_size=4, model=model())
    big_run = fit(tmp_path / "big", [big], batch_size=16, model=model())
    assert len(small.grads) == len(big.grads) == 4
    for mine, reference in zip(small.grads, big.grads, strict=True):
        for a, b in zip(mine, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    small_params, big_params = small_run.state.model.parameters(), big_run.state.model.parameters()
    for a, b in zip(small_params, big_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_loss_is_divided_for_backward_only_and_logged_undivided(tmp_path):
    recorder, backward = Recorder(), RecordingBackward()
    # 4 batches per epoch in groups of 3: the last group of each epoch has 1 batch.
    trainer = fit(
        tmp_path,
        [accumulate(3), recorder, backward],
        batch_size=16,
        max_duration="2ep",
        log_interval=1,
    )
    assert loss_factors(backward, recorder) == pytest.approx([1 / 3, 1 / 3, 1 / 3, 1.0] * 2)
    assert recorder.steps == [2, 3, 6, 7]
    assert recorder.backward_losses == recorder.losses  # restored after backward
    logged = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in logged if r["kind"] == "train"] == pytest.approx(recorder.losses)


@pytest.mark.parametrize(
    "max_duration, batch_size",
    [("6ba", 4), ("1.5ep", 16), ("24sp", 4)],  # 6 batches; "1.5ep" also ends an epoch at 4
)
def test_a_run_ending_inside_a_group_steps_at_its_last_batch(tmp_path, max_duration, batch_size):
    recorder, backward = Recorder(), RecordingBackward()
    algos = [accumulate(4), recorder, backward]
    trainer = fit(tmp_path, algos, max_duration=max_duration, batch_size=batch_size)
    assert recorder.steps == [3, 5]
    assert loss_factors(backward, recorder) == pytest.approx([1 / 4] * 4 + [1 / 2] * 2)
    assert "grad_accumulation_dropped_batches" not in trainer.summary


def test_resume_mid_group_keeps_the_step_batches_and_averages_what_remains(tmp_path):
    full = Recorder()
    fit(tmp_path / "full", [accumulate(4), full], max_duration="2ep")

    first, backward = Recorder(stop_at=6), RecordingBackward()
    stopped = fit(
        tmp_path / "resume", [accumulate(4), first], max_duration="2ep", checkpoint_interval="1ep"
    )
    # Interrupted inside the group of batches 4..7: its gradients are dropped.
    assert stopped.summary["grad_accumulation_dropped_batches"] == 2
    assert all(p.grad is None for p in stopped.state.model.parameters())

    second = Recorder()
    fit(
        tmp_path / "resume",
        [accumulate(4), second, backward],
        max_duration="2ep",
        load_path=stopped.run_dir / "checkpoints" / "latest.pt",
    )
    assert first.steps + second.steps == full.steps
    # Batches 6 and 7 finish the interrupted group alone, so each weighs 1/2.
    weights = loss_factors(backward, second)
    assert weights[:2] == pytest.approx([1 / 2, 1 / 2])
    assert weights[2:] == pytest.approx([1 / 4] * (len(weights) - 2))


def test_ddp_skips_the_all_reduce_on_batches_that_do_not_step(tmp_path):
    # A file store, not a port: nothing to collide with a test on another xdist worker.
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(linear_model())
        backward = RecordingBackward()
        fit(tmp_path, [accumulate(4), backward], model=ddp, max_duration="8ba")
        assert [sync for _, _, sync in backward.seen] == [False, False, False, True] * 2
        # Without accumulation every backward all-reduces.
        backward = RecordingBackward()
        fit(tmp_path / "plain", [backward], model=ddp, max_duration="2ba")
        assert [sync for _, _, sync in backward.seen] == [True, True]
        # Found under torch.compile's wrapper too (importing dynamo takes seconds: a stand-in).
        assert _find_ddp(SimpleNamespace(_orig_mod=ddp)) is ddp
        assert _find_ddp(linear_model()) is None
    finally:
        dist.destroy_process_group()


def test_steps_one_changes_nothing(tmp_path):
    one = fit(tmp_path / "one", [accumulate(1)])
    plain = fit(tmp_path / "plain", [])
    for a, b in zip(one.state.model.parameters(), plain.state.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# -- config and discovery ----------------------------------------------------------------


def test_config_errors_name_the_key_and_what_is_allowed():
    with pytest.raises(ConfigError, match=r"algorithms.grad_accumulation: steps must be a whole number >= 1.*got 0"):
        plugin_config(GradAccumulation, {"steps": 0})
    with pytest.raises(ConfigError, match=r"algorithms.grad_accumulation.steps: .*expected int"):
        plugin_config(GradAccumulation, {"steps": "four"})
    assert plugin_config(GradAccumulation, {}) == GradAccumulationConfig(steps=4)
