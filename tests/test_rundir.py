"""The run-directory contract: overwrite clears exactly a run's files, a failed start
blocks no retry, writes are atomic and durable with the usual permissions."""

import json
import os
import re
import stat
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from helpers import Probe, train
from slipstream import Callback, CheckpointError, ConfigError, hookimpl
from slipstream.run.directory import RunDir, atomic_write, atomic_write_text
from slipstream.run.results import compare_runs_json, load_run


def steps(run_dir: Path, kind: str) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if r["kind"] == kind]


def test_overwrite_leaves_only_the_new_runs_files_and_the_users_own(tmp_path):
    first = train(tmp_path, [], max_duration="2ep", log_interval=1, checkpoint_interval="1ep")
    run = first.run_dir
    (run / "notes.txt").write_text("mine")
    (run / "checkpoints" / "exported.pt").write_bytes(b"mine")
    with pytest.raises(ConfigError, match="already holds a run"):
        train(tmp_path, [], max_duration="3ba")
    second = train(tmp_path, [], max_duration="3ba", log_interval=1, overwrite=True)
    assert steps(run, "train") == [1, 2, 3] and steps(run, "eval") == [3]
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["best.pt", "ep0-ba3.pt", "exported.pt", "latest.pt"]
    # best.pt is the new run's (its one evaluation, at step 3), not the old run's best
    assert torch.load(run / "checkpoints" / "best.pt", weights_only=True)["best"]["step"] == 3
    assert (run / "notes.txt").read_text() == "mine"
    row = compare_runs_json([load_run(run)])[0]
    assert row["best_accuracy_pct"] == pytest.approx(100 * second.summary["accuracy"])


def test_clear_removes_the_contract_files_only(tmp_path):
    paths = RunDir(tmp_path)
    for path in (paths.config, paths.metrics, paths.summary, paths.latest, paths.best,
                 paths.checkpoint(1, 10), paths.checkpoints / ".latest.pt.0123456789abcdef.tmp"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    for name in ("data.csv", "checkpoints/mine.pt", "metrics.jsonl.bak"):
        (tmp_path / name).write_text("keep")
    assert len(paths.clear()) == 7
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["checkpoints/mine.pt", "data.csv", "metrics.jsonl.bak"]


def test_shard_folders_of_sharded_checkpoints_belong_to_the_run(tmp_path):
    paths = RunDir(tmp_path)
    shards = paths.shards(0, 3)
    assert shards == paths.shards_of(paths.checkpoint(0, 3)) == tmp_path / "checkpoints" / "ep0-ba3.dcp"
    shards.mkdir(parents=True)
    (shards / "__0_0.distcp").write_text("x")
    (tmp_path / "checkpoints" / "mine.dcp").mkdir()  # not a name the run writes
    assert paths.holds_run() == ["checkpoints/ep0-ba3.dcp"]  # protected like a checkpoint
    assert shards in paths.clear()
    assert not shards.exists() and (tmp_path / "checkpoints" / "mine.dcp").is_dir()


def test_a_missing_load_path_fails_before_touching_the_run_dir(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        train(tmp_path, [], max_duration="2ba", load_path=tmp_path / "nope.pt")
    assert not (tmp_path / "run").exists()


def test_a_corrupt_load_path_overwrites_nothing(tmp_path):
    first = train(tmp_path, [], max_duration="2ba", log_interval=1)
    before = {p: p.read_bytes() for p in RunDir(first.run_dir).run_files()}
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="corrupt"):
        train(tmp_path, [], max_duration="4ba", load_path=bad, overwrite=True)
    assert {p: p.read_bytes() for p in RunDir(first.run_dir).run_files()} == before


def test_a_start_on_empty_data_does_not_block_the_retry(tmp_path):
    empty = DataLoader(TensorDataset(torch.zeros(0, 3, 16, 16), torch.zeros(0, dtype=torch.long)))
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 4))
    from slipstream import Trainer

    with pytest.raises(ConfigError, match="yielded no batches; its dataset is empty"):
        Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                train_data=empty, run_dir=tmp_path / "run", device="cpu", progress_bar=False,
                verbose=False).fit()
    retry = train(tmp_path, [], max_duration="2ba", log_interval=1)
    assert retry.summary["status"] == "completed" and steps(retry.run_dir, "train") == [1, 2]


@pytest.mark.parametrize("world_size", [1, 2])
def test_data_smaller_than_one_batch_says_the_numbers_and_what_to_change(tmp_path, world_size):
    # 5 samples, batches of 4 per process, the partial batch dropped: no batch at all
    # with 2 processes (5 < 8), which the error says in numbers, not "check the data".
    from slipstream import Trainer
    from slipstream.data import build_loader

    data = TensorDataset(torch.zeros(5, 3, 16, 16), torch.zeros(5, dtype=torch.long))
    loaders = {
        1: DataLoader(data, batch_size=8, drop_last=True),
        2: build_loader(data, batch_size=4, rank=0, world_size=2),
    }
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 4))
    with pytest.raises(ConfigError) as err:
        Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                train_data=loaders[world_size], run_dir=tmp_path / "run", device="cpu",
                progress_bar=False, verbose=False).fit()
    batch = "8" if world_size == 1 else "4 x 2 processes"
    assert f"its 5 samples are fewer than one batch of {batch}, and drop_last drops" in str(err.value)
    assert f"a batch size of at most {5 // world_size}" in str(err.value) and "drop_last=False" in str(err.value)


class FailAt3(Probe):
    def __init__(self):
        super().__init__(batch_end=self.fail)

    @staticmethod
    def fail(state):
        if state.timestamp.batch == 3:
            raise RuntimeError("injected failure")


def test_the_resume_path_a_message_suggests_exists(tmp_path):
    with pytest.raises(RuntimeError):  # records written, no checkpoint yet
        train(tmp_path / "a", [FailAt3()], max_duration="6ba", log_interval=1)
    with pytest.raises(ConfigError) as no_checkpoint:
        train(tmp_path / "a", [], max_duration="2ba")
    assert "load_path" not in str(no_checkpoint.value)

    train(tmp_path / "b", [], max_duration="2ba")
    with pytest.raises(ConfigError) as with_checkpoint:
        train(tmp_path / "b", [], max_duration="2ba")
    suggested = re.search(r"trainer\.load_path=(\S+?),", str(with_checkpoint.value)).group(1)
    assert Path(suggested).is_file()


def test_overwrite_refuses_to_delete_the_checkpoint_it_resumes_from(tmp_path):
    first = train(tmp_path, [], max_duration="2ba")
    latest = first.run_dir / "checkpoints" / "latest.pt"
    with pytest.raises(ConfigError, match="would delete"):
        train(tmp_path, [], max_duration="4ba", load_path=latest, overwrite=True)
    assert latest.is_file()


def test_checkpoints_get_the_permissions_of_the_other_run_files(tmp_path):
    previous = os.umask(0o022)
    try:
        trainer = train(tmp_path, [], max_duration="1ba")
    finally:
        os.umask(previous)
    paths = RunDir(trainer.run_dir)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (
        paths.metrics, paths.summary, paths.latest, paths.checkpoint(0, 1))}
    assert set(modes.values()) == {0o644}, modes


def test_atomic_write_is_durable_and_leaves_the_old_file_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"
    target.write_text("old")
    synced: list[bool] = []
    real_fsync = os.fsync

    def spy(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)

    def broken(f):
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, broken)
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["summary.json"]

    atomic_write_text(target, "new")
    assert target.read_text() == "new" and os.listdir(tmp_path) == ["summary.json"]
    assert synced == [False, True]  # the file's data, then the directory's rename


class _Logger(Callback):
    """Writes one file per run into its own folder, as a logger does."""

    name = "folder_logger"
    run_files = ("mylog",)

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag

    @hookimpl
    def fit_start(self, state) -> None:
        folder = Path(state.run_dir) / "mylog"
        folder.mkdir(exist_ok=True)
        (folder / self.tag).write_text(self.tag)


def test_overwrite_removes_the_previous_runs_plugin_folders_too(tmp_path):
    train(tmp_path, [], max_duration="1ba", callbacks=[_Logger("first")])
    run = tmp_path / "run"
    (run / "tensorboard").mkdir()  # an installed logger's folder from the run before
    (run / "tensorboard" / "events.out").write_text("old steps")
    (run / "notes.txt").write_text("the user's own")
    train(tmp_path, [], max_duration="1ba", callbacks=[_Logger("second")], overwrite=True)
    assert sorted(p.name for p in (run / "mylog").iterdir()) == ["second"]
    assert not (run / "tensorboard").exists()
    assert (run / "notes.txt").read_text() == "the user's own"
