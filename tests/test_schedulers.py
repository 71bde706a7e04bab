"""The Trainer's ``schedulers``: torch LR schedulers stepped per epoch (the default)
or per optimizer step, their state in checkpoints."""

import pytest
import torch

from helpers import Probe, tiny_loaders, tiny_model
from slipstream import ConfigError, Trainer

BATCHES_PER_EPOCH = 4  # tiny_loaders: 64 samples, batch 16


def _fit(tmp_path, interval=None, schedule=True, max_duration="2ep", load_path=None):
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedulers = [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)] if schedule else []
    seen: list[float] = []
    probe = Probe(before_forward=lambda state: seen.append(state.optimizer.param_groups[0]["lr"]))
    train_data, _ = tiny_loaders()
    extra = {} if interval is None else {"scheduler_interval": interval}
    trainer = Trainer(
        model=model,
        optimizer=optimizer,
        train_data=train_data,
        max_duration=max_duration,
        algorithms=[probe],
        schedulers=schedulers,
        run_dir=tmp_path / "run",
        device="cpu",
        progress_bar=False,
        verbose=False,
        eval_interval=None,
        checkpoint_interval="1ep",
        load_path=load_path,
        **extra,
    )
    trainer.fit()
    return trainer, seen


def test_schedulers_step_at_each_epochs_end_by_default(tmp_path):
    trainer, seen = _fit(tmp_path)
    assert seen == [0.1] * BATCHES_PER_EPOCH + [0.05] * BATCHES_PER_EPOCH
    assert trainer.state.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)


def test_schedulers_step_after_every_optimizer_step_when_asked(tmp_path):
    _, seen = _fit(tmp_path, interval="batch", max_duration="4ba")
    assert seen == pytest.approx([0.1, 0.05, 0.025, 0.0125])


def test_without_schedulers_the_lr_stays(tmp_path):
    _, seen = _fit(tmp_path, schedule=False)
    assert seen == [0.1] * (2 * BATCHES_PER_EPOCH)


def test_a_resumed_run_continues_the_schedule(tmp_path):
    first, _ = _fit(tmp_path / "a", max_duration="1ep")
    resumed, seen = _fit(tmp_path / "b", load_path=first.run_dir / "checkpoints" / "latest.pt")
    assert seen == [0.05] * BATCHES_PER_EPOCH  # the second epoch only, at the stepped LR
    assert resumed.state.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)


def test_an_unknown_interval_says_what_is_allowed(tmp_path):
    with pytest.raises(ConfigError, match="scheduler_interval must be one of epoch, batch, got 'step'"):
        _fit(tmp_path, interval="step")
