"""Checkpoints: contents, atomic writes, clear errors, resume, SIGTERM."""

import json
import os
import signal
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from helpers import Probe, tiny_loaders, tiny_model, train
from slipstream import Algorithm, CheckpointError, ConfigError, Trainer, hookimpl, load_checkpoint


class Counter(Algorithm):
    """A plugin with state, to check it is saved and restored."""

    name = "counter"

    def __init__(self):
        super().__init__()
        self.count = 0

    @hookimpl
    def batch_end(self, state):
        self.count += 1

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_checkpoint_contents_load_with_weights_only(tmp_path):
    trainer = train(tmp_path, [Counter()], max_duration="2ep", checkpoint_interval="1ep")
    folder = trainer.run_dir / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["best.pt", "ep1-ba4.pt", "ep2-ba8.pt", "latest.pt"]
    payload = torch.load(folder / "latest.pt", weights_only=True)
    assert set(payload) >= {"model", "optimizer", "plugins", "timestamp", "config", "rng"}
    assert payload["model"].keys() == trainer.state.unwrapped_model.state_dict().keys()
    assert payload["plugins"]["counter"]["state"] == {"count": 8}
    assert payload["plugins"]["counter"]["config"] == {}
    assert "version" in payload["plugins"]["counter"]
    assert payload["timestamp"]["batch"] == 8 and payload["timestamp"]["epoch"] == 2


def test_checkpoint_interval_in_batches_keeps_the_newest(tmp_path):
    trainer = train(
        tmp_path,
        [],
        max_duration="6ba",
        checkpoint_interval="2ba",
        checkpoint_keep=2,
        eval_interval=None,
    )
    names = sorted(p.name for p in (trainer.run_dir / "checkpoints").iterdir())
    # ba4 ends epoch 0: named with the epochs done there, as a checkpoint at its epoch_end is
    assert names == ["ep1-ba4.pt", "ep1-ba6.pt", "latest.pt"]
    epoch_end = train(tmp_path / "ep", [], max_duration="4ba", checkpoint_interval="1ep", eval_interval=None)
    assert sorted(p.name for p in (epoch_end.run_dir / "checkpoints").iterdir()) == ["ep1-ba4.pt", "latest.pt"]


def test_checkpoint_keep_holds_across_a_resume_and_0_keeps_only_latest(tmp_path):
    kwargs = dict(checkpoint_interval="1ba", checkpoint_keep=2, eval_interval=None, autoresume=True)
    first = train(tmp_path / "a", [], max_duration="4ba", **kwargs)
    folder = first.run_dir / "checkpoints"
    def steps():
        return sorted(int(p.stem.split("-ba")[1]) for p in folder.glob("ep*-ba*.pt"))

    assert steps() == [3, 4]
    train(tmp_path / "a", [], max_duration="6ba", **kwargs)  # a requeued job goes on in place
    assert steps() == [5, 6]
    none = train(tmp_path / "b", [], max_duration="3ba", **{**kwargs, "checkpoint_keep": 0})
    assert sorted(p.name for p in (none.run_dir / "checkpoints").iterdir()) == ["latest.pt"]
    assert load_checkpoint(none.run_dir / "checkpoints" / "latest.pt")["timestamp"]["batch"] == 3


def test_no_temporary_files_are_left_behind(tmp_path):
    trainer = train(tmp_path, [], max_duration="1ep")
    assert not [p for p in (trainer.run_dir / "checkpoints").iterdir() if p.name.startswith(".")]


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="cannot be read: this is a text file, not a checkpoint"):
        load_checkpoint(bad)
    torch.save({"weights": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a Slipstream checkpoint"):
        load_checkpoint(tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt")


def test_checkpoints_keep_their_format_tag_and_older_ones_still_resume(tmp_path):
    # "slipstream.checkpoint" is what every checkpoint since the first release says;
    # the engine's regrouping wrote "slipstream.run.checkpoint" for a day. Both resume.
    first = train(tmp_path / "a", [Counter()], max_duration="2ba", checkpoint_interval="2ba")
    latest = first.run_dir / "checkpoints" / "latest.pt"
    payload = torch.load(latest, weights_only=True)
    assert payload["format"] == "slipstream.checkpoint" and payload["format_version"] == 1
    for tag in ("slipstream.checkpoint", "slipstream.run.checkpoint"):
        old = tmp_path / f"{tag}.pt"
        torch.save({**payload, "format": tag}, old)
        counter = Counter()
        resumed = train(tmp_path / tag, [counter], max_duration="3ba", load_path=old)
        assert resumed.state.timestamp.batch == 3 and counter.count == 3


@pytest.mark.parametrize("cut", ["2ba", "1ep"])
def test_a_resume_on_another_number_of_processes_says_what_changes(tmp_path, cut):
    first = train(tmp_path / "a", [], max_duration=cut, checkpoint_interval=cut, eval_interval=None)
    latest = first.run_dir / "checkpoints" / "latest.pt"
    payload = torch.load(latest, weights_only=True)
    assert payload["world_size"] == 1
    with warnings.catch_warnings(record=True) as same:
        warnings.simplefilter("always")
        train(tmp_path / "same", [], max_duration="3ba", load_path=latest, eval_interval=None)
    assert not [w for w in same if "processes" in str(w.message)]
    torch.save({**payload, "world_size": 2}, tmp_path / "two.pt")  # as 2 processes write it
    with pytest.warns(UserWarning, match="written by 2 processes and this run has 1") as told:
        resumed = train(tmp_path / "two", [], max_duration="3ba", load_path=tmp_path / "two.pt", eval_interval=None)
    message = str(told[0].message)
    batch = first.state.global_batch_size
    assert f"a step now averages {batch} samples instead of {2 * batch}" in message
    assert "Resume with 2 processes to continue it exactly" in message
    mid_epoch = payload["timestamp"]["batch_in_epoch"] > 0
    assert ("seen twice" in message) == mid_epoch, message
    assert resumed.summary["status"] == "completed"


def test_a_resume_with_another_learning_rate_says_the_checkpoints_is_kept(tmp_path):
    first = train(tmp_path / "a", [], max_duration="2ba", checkpoint_interval="2ba", lr=0.05)
    latest = first.run_dir / "checkpoints" / "latest.pt"
    with warnings.catch_warnings(record=True) as same:
        warnings.simplefilter("always")
        train(tmp_path / "same", [], max_duration="3ba", load_path=latest, lr=0.05)
    assert not [w for w in same if "differ from the run" in str(w.message)]
    with pytest.warns(UserWarning, match=r"optimizer.lr stays 0.05 \(0.001 asked\)") as told:
        resumed = train(tmp_path / "b", [], max_duration="3ba", load_path=latest, lr=0.001)
    message = next(str(w.message) for w in told if "differ from the run" in str(w.message))
    assert "trainer.load_weights_only=true" in message and "Taking effect" not in message
    # What the warning says is what happened, and what the run directory records.
    assert [g["lr"] for g in resumed.state.optimizer.param_groups] == [0.05]
    assert resumed.summary["resumed_with_changes"] == ["optimizer.lr"]
    assert yaml.safe_load((resumed.run_dir / "config.yaml").read_text())["optimizer"]["lr"] == 0.05
    later = torch.load(resumed.run_dir / "checkpoints" / "latest.pt", weights_only=True)
    assert later["config"]["optimizer"]["lr"] == 0.05


def test_a_resume_already_at_its_duration_says_nothing_is_left(tmp_path):
    first = train(tmp_path / "a", [], max_duration="4ba", checkpoint_interval="4ba", eval_interval=None)
    latest = first.run_dir / "checkpoints" / "latest.pt"
    with pytest.warns(UserWarning, match=r"is at step 4 \(epoch \d\), already at trainer.max_duration=3ba"):
        done = train(tmp_path / "b", [], max_duration="3ba", load_path=latest, eval_interval=None)
    assert done.state.timestamp.batch == 4 and done.summary["status"] == "completed"
    with warnings.catch_warnings(record=True) as more:
        warnings.simplefilter("always")
        train(tmp_path / "c", [], max_duration="5ba", load_path=latest, eval_interval=None)
    assert not [w for w in more if "nothing is left to train" in str(w.message)]
    with pytest.warns(UserWarning, match=r"this Trainer is at step 4 .*nothing is left to train"):
        assert first.fit()["batches"] == 4  # fit() again: the run is over


def test_a_finished_run_resumed_again_is_left_as_it_is(tmp_path):
    """A requeued job that had finished (autoresume) trains nothing and writes nothing:
    no second final evaluation in the log, no summary of an empty session (0 samples/s)
    over the finished run's."""
    kwargs = dict(max_duration="2ba", checkpoint_interval="2ba", eval_interval="2ba", autoresume=True)
    first = train(tmp_path, [], **kwargs)
    files = {name: (first.run_dir / name).read_bytes() for name in ("metrics.jsonl", "summary.json")}
    assert json.loads(files["summary.json"])["samples_per_s"] > 0
    with pytest.warns(UserWarning, match="nothing is left to train, and the run directory is left as it is"):
        again = train(tmp_path, [], **kwargs)
    assert {name: (first.run_dir / name).read_bytes() for name in files} == files
    assert again.summary == json.loads(files["summary.json"])


def test_a_shuffling_dataloader_resumed_inside_an_epoch_says_it_is_not_exact(tmp_path):
    from torch.utils.data import DataLoader

    dataset = tiny_loaders()[0].dataset  # 4 batches of 16 an epoch
    shuffled = DataLoader(dataset, batch_size=16, shuffle=True)
    first = train(tmp_path / "a", [], train_data=shuffled, max_duration="2ba", checkpoint_interval="2ba",
                  eval_interval=None)  # fmt: skip
    latest = first.run_dir / "checkpoints" / "latest.pt"
    with pytest.warns(UserWarning, match="RandomSampler cannot resume inside an epoch: the rest of epoch 0"):
        train(tmp_path / "b", [], train_data=shuffled, max_duration="3ba", load_path=latest, eval_interval=None)
    # In order (SequentialSampler), skipping the first batches is exact: nothing to say.
    in_order = DataLoader(dataset, batch_size=16, shuffle=False)
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        train(tmp_path / "c", [], train_data=in_order, max_duration="3ba", load_path=latest, eval_interval=None)
    assert not [w for w in told if "cannot resume inside an epoch" in str(w.message)]


def test_checkpoint_that_does_not_fit_the_model(tmp_path):
    first = train(tmp_path / "a", [], max_duration="1ba")
    other = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 4))
    expected = r"does not fit this model \(Sequential\): missing from the checkpoint: 1.weight, 1.bias; unexpected"
    with pytest.raises(CheckpointError, match=expected) as info:
        train(
            tmp_path / "b",
            [],
            model=other,
            max_duration="2ba",
            load_path=first.run_dir / "checkpoints" / "latest.pt",
        )
    assert "Error(s) in loading state_dict" not in str(info.value)  # torch's wording, hundreds of characters


def _params(trainer):
    return [p.detach().clone() for p in trainer.state.unwrapped_model.parameters()]


def test_resume_mid_epoch_is_bit_exact(tmp_path):
    straight = train(
        tmp_path / "straight", [Counter()], max_duration="6ba", checkpoint_interval=None
    )
    first = train(tmp_path / "split", [Counter()], max_duration="3ba", checkpoint_interval="3ba")
    counter = Counter()
    resumed = train(
        tmp_path / "split",
        [counter],
        max_duration="6ba",
        load_path=first.run_dir / "checkpoints" / "latest.pt",
    )
    assert resumed.state.timestamp.batch == 6 and counter.count == 6
    for a, b in zip(_params(straight), _params(resumed), strict=True):
        assert torch.equal(a, b)
    records = [
        json.loads(line) for line in (resumed.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert any(r["kind"] == "train" and r["step"] == 6 for r in records)  # appended, not replaced


def test_a_run_directory_holding_a_run_is_not_reused(tmp_path):
    train(tmp_path, [], max_duration="1ba")
    with pytest.raises(ConfigError, match="already holds a run"):
        train(tmp_path, [], max_duration="1ba")


class FailAt(Algorithm):
    """Fails in the middle of the third batch: after its loss, before any batch_end,
    so no interval checkpoint is due whatever order the plugins run in."""

    name = "fail_at"

    @hookimpl
    def after_loss(self, state):
        if state.timestamp.batch == 2:  # the batch that would complete step 3
            raise RuntimeError("injected failure")


def test_a_failed_run_overwrites_no_checkpoint(tmp_path):
    first = train(tmp_path, [], max_duration="2ba")
    latest = first.run_dir / "checkpoints" / "latest.pt"
    before = latest.read_bytes()
    with pytest.raises(RuntimeError, match="injected failure"):
        train(tmp_path, [FailAt()], max_duration="6ba", load_path=latest, checkpoint_interval="1ba")
    # The failure is the only way this run ends: nothing it saves on the way out
    # (the state of a batch that failed half-way) may replace the last good checkpoint.
    assert latest.read_bytes() == before
    assert sorted(p.name for p in latest.parent.iterdir()) == ["best.pt", "ep0-ba2.pt", "latest.pt"]


def test_sigterm_ends_the_run_cleanly_with_a_checkpoint(tmp_path):
    probe = Probe(
        batch_end=lambda s: os.kill(os.getpid(), signal.SIGTERM) if s.timestamp.batch == 2 else None
    )
    trainer = train(tmp_path, [probe], max_duration="4ep")
    assert trainer.state.timestamp.batch == 2
    summary = json.loads((trainer.run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert load_checkpoint(trainer.run_dir / "checkpoints" / "latest.pt")["timestamp"]["batch"] == 2
    assert "fit_end" in probe.events


def test_wall_clock_budget_ends_cleanly_and_dur_is_the_fraction_of_the_budget(tmp_path, monkeypatch):
    # A fake clock on which each batch takes 0.125 s (exact in binary): how fast this machine trains
    # cannot change where the 1 s budget ends.
    from types import SimpleNamespace

    from slipstream import state as state_module

    now = [0.0]
    monkeypatch.setattr(state_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    fractions = []
    probe = Probe(
        batch_start=lambda s: now.__setitem__(0, now[0] + 0.125),
        batch_end=lambda s: fractions.append(s.time_in("dur")),
    )
    train_data, eval_data = tiny_loaders()
    model = tiny_model()
    trainer = Trainer(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        train_data=train_data,
        eval_data=eval_data,
        max_duration="1s",
        algorithms=[probe],
        run_dir=tmp_path / "run",
        device="cpu",
        progress_bar=False,
        verbose=False,
        eval_interval=None,
        checkpoint_interval=None,
    )
    summary = trainer.fit()
    assert summary["status"] == "completed"
    assert trainer.state.timestamp.batch == 8  # 8 batches of 0.125 s: the budget, to the batch
    assert trainer.state.timestamp.elapsed_s == pytest.approx(1.0)
    assert fractions == sorted(fractions) and fractions[-1] == 1.0 and fractions[0] == 0.125


def test_a_resumed_runs_throughput_counts_its_own_session(tmp_path, monkeypatch):
    # A fake clock: batches take 1 s before the resume and 2 s after it. The summary's
    # samples/s is the resumed session's own (3 batches x 16 samples in 6 s), not a
    # mix with the first session's samples or seconds (State.session_samples and
    # State.session_elapsed_s).
    from types import SimpleNamespace

    from slipstream import state as state_module

    now = [0.0]
    monkeypatch.setattr(state_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def every_batch_takes(seconds):
        return Probe(batch_start=lambda state: now.__setitem__(0, now[0] + seconds))

    first = train(
        tmp_path, [every_batch_takes(1.0)], max_duration="3ba", eval_interval=None, checkpoint_interval="3ba"
    )
    assert first.summary["samples_per_s"] == pytest.approx(16.0)
    resumed = train(
        tmp_path,
        [every_batch_takes(2.0)],
        max_duration="6ba",
        eval_interval=None,
        load_path=first.run_dir / "checkpoints" / "latest.pt",
    )
    assert resumed.summary["wall_time_s"] == pytest.approx(9.0)  # the run's clock goes on
    assert resumed.summary["samples_per_s"] == pytest.approx(8.0)
    # The rate is this session's, and the summary says from which step it counts.
    assert resumed.summary["session_from_step"] == 3 and "session_from_step" not in first.summary


class OwnsModelState(Algorithm):
    """A parallelism plugin in miniature: wraps the model, and saves and loads the
    model and optimizer state its own way (the weights stored negated)."""

    name = "owns_model_state"

    def __init__(self):
        super().__init__()
        self.wrapped = False
        self.loaded = None

    @hookimpl
    def wrap_model(self, state):
        self.wrapped = True
        return torch.nn.Sequential(state.model)  # a wrapper, as DDP is one

    @hookimpl
    def state_dicts(self, state):
        weights = state.model[0].state_dict()
        return {"model": {k: -v for k, v in weights.items()}, "optimizer": state.optimizer.state_dict()}

    @hookimpl
    def load_state_dicts(self, state, state_dicts):
        self.loaded = state_dicts
        state.model.load_state_dict({k: -v for k, v in state_dicts["model"].items()})
        state.optimizer.load_state_dict(state_dicts["optimizer"])
        return True


def test_a_plugin_owns_wrapping_saving_and_loading_through_the_step_hooks(tmp_path):
    owner = OwnsModelState()
    first = train(tmp_path / "a", [owner], max_duration="2ba", checkpoint_interval="2ba")
    assert owner.wrapped and isinstance(first.state.model, torch.nn.Sequential)
    payload = load_checkpoint(first.run_dir / "checkpoints" / "latest.pt")
    live = first.state.model[0].state_dict()
    assert all(torch.equal(payload["model"][k], -live[k]) for k in live)  # the plugin's format
    reader = OwnsModelState()
    resumed = train(tmp_path / "b", [reader], max_duration="2ba", load_path=first.run_dir / "checkpoints" / "latest.pt")
    assert reader.loaded is not None  # the plugin loaded it, not the engine's default
    assert resumed.state.timestamp.batch == 2  # nothing left to train: the weights are as loaded
    assert all(torch.equal(v, live[k]) for k, v in resumed.state.unwrapped_model.state_dict().items())


def test_a_changed_plugin_option_is_named_with_its_values_not_as_the_plugin_on_and_on():
    from slipstream.run.checkpoint import config_differences, resumed_with_changes

    saved = {"algorithms": {"ema": {}, "mixup": {"alpha": 0.2}}, "optimizer": {"lr": 0.1}}
    asked = {"algorithms": {"ema": {"decay": 0.9}, "mixup": {"alpha": 0.4}}, "optimizer": {"lr": 0.1}}
    keys = config_differences(saved, asked)
    assert keys == ["algorithms.ema.decay", "algorithms.mixup.alpha"]
    message = resumed_with_changes(Path("latest.pt"), saved, asked, keys)
    assert "algorithms.ema.decay its default -> 0.9, algorithms.mixup.alpha 0.2 -> 0.4" in message
    # A plugin switched on or off is still named as the plugin.
    assert config_differences(saved, {"algorithms": {"mixup": {"alpha": 0.2}}, "optimizer": {"lr": 0.1}}) == [
        "algorithms.ema"
    ]
    assert "algorithms.ema on -> off" in resumed_with_changes(
        Path("latest.pt"), saved, {"algorithms": {"mixup": {"alpha": 0.2}}}, ["algorithms.ema"]
    )


def test_a_resume_on_more_processes_with_the_same_global_batch_says_so():
    """1 process of 32 written, 2 of 16 resuming: the global batch is 32 on both sides
    (it used to be told as 16 before, from this run's per-process batch)."""
    from types import SimpleNamespace

    from slipstream.run.checkpoint import world_size_changed
    from slipstream.state import Timestamp

    state = SimpleNamespace(world_size=2, global_batch_size=32, timestamp=Timestamp())
    same = world_size_changed(Path("latest.pt"), 1, state, saved_batch=32)
    assert "a step still averages 32 samples, now 16 from each process" in same
    halved = world_size_changed(Path("latest.pt"), 1, state, saved_batch=64)
    assert "a step now averages 32 samples instead of 64" in halved
    unknown = world_size_changed(Path("latest.pt"), 1, state)  # no config: this run's per-process batch
    assert "a step now averages 32 samples instead of 16" in unknown
