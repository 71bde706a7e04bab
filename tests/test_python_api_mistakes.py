"""What a user of the Python API gets wrong, told in one line before it costs a run, and
what the engine must not get wrong for them silently (session 20's walkthrough)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau, StepLR
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from slipstream import ConfigError, Trainer
from slipstream.errors import ConfigWarning
from slipstream.state import State


def _data(n: int = 16, batch_size: int = 4, targets: torch.Tensor | None = None, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 3, 4, 4, generator=g, dtype=dtype)
    y = torch.arange(n) % 4 if targets is None else targets
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(48, 4))


def _trainer(tmp_path, model=None, name="run", optimizer=None, **kwargs) -> Trainer:
    model = model or _model()
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs = {"train_data": _data(), "max_duration": "2ba", "progress_bar": False, "verbose": False, **kwargs}
    return Trainer(model=model, optimizer=optimizer, run_dir=tmp_path / name, **kwargs)


def _records(run_dir, kind):
    lines = (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r for r in lines if r["kind"] == kind]


def test_a_scheduler_of_another_optimizer_is_refused(tmp_path):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="built on another optimizer than the Trainer's"):
        _trainer(tmp_path, model, optimizer=optimizer, schedulers=[StepLR(other, 1)])
    with pytest.raises(ConfigError, match="ReduceLROnPlateau steps on a metric"):
        _trainer(tmp_path, model, optimizer=optimizer, schedulers=[ReduceLROnPlateau(optimizer)])
    with pytest.raises(ConfigError, match="schedulers must be a list of torch LR schedulers, got int"):
        _trainer(tmp_path, model, optimizer=optimizer, schedulers=5)


def test_one_scheduler_alone_is_taken_and_moves_the_lr(tmp_path):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = _trainer(tmp_path, model, optimizer=optimizer, schedulers=StepLR(optimizer, 1, gamma=0.5),
                       max_duration="2ep", eval_interval=None)
    trainer.fit()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.025)


def test_plugin_lists_may_be_none_and_a_loss_must_be_callable(tmp_path):
    assert _trainer(tmp_path, algorithms=None, callbacks=None).algorithms == []
    with pytest.raises(ConfigError, match="loss_fn must be callable as loss_fn\\(outputs, targets\\), got str"):
        _trainer(tmp_path, name="other", loss_fn="cross_entropy")


@pytest.mark.parametrize(
    ("loss_fn", "message"),
    [
        (lambda o, y: float(F.cross_entropy(o, y).detach()), "the training loss is a float"),
        (nn.CrossEntropyLoss(reduction="none"), "the training loss has shape (4,)"),
        (lambda o, y: F.cross_entropy(o, y).detach(), "does not depend on the model's parameters"),
    ],
    ids=["float", "unreduced", "detached"],
)
def test_a_loss_that_cannot_train_says_why(tmp_path, loss_fn, message):
    with pytest.raises(ConfigError) as caught:
        _trainer(tmp_path, loss_fn=loss_fn).fit()
    assert message in str(caught.value)


def test_the_eval_loss_is_the_users_loss_and_plain_cross_entropy_for_cross_entropy(tmp_path):
    data = _data()

    def scaled(outputs, targets):
        return 100 * F.cross_entropy(outputs, targets)

    summaries = {}
    for name, loss_fn in (("scaled", scaled), ("smoothed", nn.CrossEntropyLoss(label_smoothing=0.5))):
        model = _model()
        trainer = _trainer(tmp_path, model, name=name, loss_fn=loss_fn, eval_data=data, normalize=None)
        summaries[name] = trainer.fit()
        (record,) = _records(tmp_path / name, "eval")
        with torch.no_grad():
            logits = torch.cat([model(x) for x, _ in data])
            targets = torch.cat([y for _, y in data])
        plain = F.cross_entropy(logits, targets).item()
        expected = 100 * plain if name == "scaled" else plain  # smoothing left out of the eval loss
        assert record["loss"] == pytest.approx(expected, rel=1e-5)


def test_one_hot_targets_are_evaluated_by_their_class(tmp_path):
    indices = torch.arange(16) % 4
    data = _data(targets=F.one_hot(indices, 4).float())
    model = _model()
    summary = _trainer(tmp_path, model, eval_data=data, normalize=None).fit()
    with torch.no_grad():
        predicted = torch.cat([model(x) for x, _ in data]).argmax(1)
    assert summary["accuracy"] == pytest.approx((predicted == indices).float().mean().item())


def test_batches_that_are_no_pair_are_refused_in_training_and_evaluation(tmp_path):
    inputs_only = DataLoader(torch.rand(8, 3, 4, 4), batch_size=4)
    with pytest.raises(ConfigError, match="a training batch must be a tuple or list .* one tensor of shape"):
        _trainer(tmp_path, train_data=inputs_only).fit()
    dict_batches = [{"x": torch.rand(4, 3, 4, 4), "y": torch.zeros(4, dtype=torch.long)}]
    with pytest.raises(ConfigError, match="an evaluation batch must be a tuple or list .* a dict with keys"):
        _trainer(tmp_path, name="eval", eval_data=dict_batches).fit()


def test_float64_images_train_and_statistics_must_match_the_channels(tmp_path):
    summary = _trainer(tmp_path, train_data=_data(dtype=torch.float64), normalize=None).fit()
    assert summary["status"] == "completed"
    with pytest.raises(ConfigError, match="the mean and std have 4 values, and the images have 3 channels"):
        _trainer(tmp_path, name="stats", normalize=((0.5,) * 4, (0.2,) * 4)).fit()


@pytest.mark.parametrize("interval", ["batch", "epoch"])
def test_the_logged_lr_is_the_one_the_step_trained_with(tmp_path, interval):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    used = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    scheduler = LambdaLR(optimizer, lambda s: 1 / (s + 1))
    trainer = _trainer(tmp_path, model, optimizer=optimizer, schedulers=[scheduler], scheduler_interval=interval,
                       max_duration="2ep", log_interval=1, eval_interval=None)
    trainer.fit()
    logged = [r["lr"] for r in _records(tmp_path / "run", "train")]
    assert len(used) == 8 and logged == pytest.approx(used)
    assert len(set(used)) == (8 if interval == "batch" else 2)


class _Stream(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for i in range(8):
            yield torch.rand(3, 4, 4, generator=g), i % 4


def test_times_inside_an_epoch_of_unknown_length_are_refused_or_warned(tmp_path):
    stream = DataLoader(_Stream(), batch_size=4)
    with pytest.raises(ConfigError, match="max_duration=1.5ep: train_data has no len()"):
        _trainer(tmp_path, train_data=stream, max_duration="1.5ep")
    with pytest.warns(ConfigWarning, match="eval_interval=0.5ep falls inside an epoch, and train_data has no len"):
        _trainer(tmp_path, name="half", train_data=stream, eval_data=stream, max_duration="2ep", eval_interval="0.5ep")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        _trainer(tmp_path, name="ba", train_data=stream, eval_data=stream, max_duration="2ep", eval_interval="1ba")


def test_a_run_ends_only_with_a_documented_status(tmp_path):
    state = _trainer(tmp_path).state
    with pytest.raises(ValueError, match="status 'bogus' is not one a run can end with"):
        state.request_stop("bogus", "enough")
    assert not state.stop_requested
    State.request_stop(state, "stopped_early", "enough")
    assert state.stop_status == "stopped_early"


def _nan_after_first(outputs, targets):
    return F.cross_entropy(outputs, targets) * float("nan")


def test_training_on_after_a_nan_is_not_advised_when_already_training_on(tmp_path):
    with pytest.warns(RuntimeWarning) as caught:
        _trainer(tmp_path, loss_fn=_nan_after_first, on_nonfinite="warn", log_interval=1).fit()
    text = " ".join(str(w.message) for w in caught if "training on" in str(w.message))
    assert "training on (trainer.on_nonfinite=warn)" in text and "set trainer.on_nonfinite=warn" not in text
    summary = _trainer(tmp_path, name="stop", loss_fn=_nan_after_first, log_interval=1).fit()
    assert summary["status"] == "diverged" and "set trainer.on_nonfinite=warn to train on" in summary["stop_reason"]


def test_early_stopping_without_an_eval_interval_is_a_warning(tmp_path):
    with pytest.warns(ConfigWarning, match="early_stopping callback never stops the run: eval_interval=None"):
        _trainer(tmp_path, eval_data=_data(), eval_interval=None, callbacks=["early_stopping"])


def test_a_second_fit_says_how_to_train_on_from_python(tmp_path):
    trainer = _trainer(tmp_path, eval_interval=None)
    trainer.fit()
    with pytest.warns(UserWarning, match="a new Trainer with a larger max_duration and load_path="):
        trainer.fit()
