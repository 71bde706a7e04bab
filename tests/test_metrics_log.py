"""metrics.jsonl is written in batches: a record made at its interval waits for the
next flush (by time, or before an evaluation's record, a checkpoint, the run's end or
its failure), so a loop of small steps does not format and write a line every few
batches; and nothing is lost or reordered by the wait."""

import errno
import json

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from helpers import Probe, train
from slipstream import Trainer, hookimpl
from slipstream.services import metrics


def train_steps_on_disk(run_dir):
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r["step"] for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "train"]


def watcher(tmp_path, seen):
    """At each batch_end (before the engine's services) note the train steps on disk."""
    return Probe(batch_end=lambda state: seen.append(train_steps_on_disk(tmp_path / "run")))


def test_records_wait_for_the_flush_and_a_checkpoint_writes_those_before_it(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "FLUSH_S", 3600.0)  # never due by time in this run
    seen = []
    trainer = train(tmp_path, [watcher(tmp_path, seen)], max_duration="6ba", log_interval=1,
                    checkpoint_interval="3ba", eval_interval=None)
    # Batch 4's watcher sees steps 1-3, written by the checkpoint of step 3; not before.
    assert [len(s) for s in seen] == [0, 0, 0, 3, 3, 3]
    assert train_steps_on_disk(trainer.run_dir) == [1, 2, 3, 4, 5, 6]  # the run's end wrote the rest


@pytest.mark.parametrize(
    ("max_duration", "eval_interval", "log_interval", "expected"),
    [
        # The last evaluation at fit_end (a run in batches), after a mid-run one; each
        # evaluation follows the train record of the steps up to it.
        ("6ba", "3ba", 4, [("train", 3), ("eval", 3), ("train", 4), ("train", 6), ("eval", 6)]),
        # The last evaluation at the last epoch_end (4 batches an epoch).
        ("2ep", "1ep", 3, [("train", 3), ("train", 4), ("eval", 4), ("train", 6), ("train", 8), ("eval", 8)]),
    ],
)
def test_a_run_ending_between_marks_logs_its_last_interval_before_the_final_evaluation(
    tmp_path, max_duration, eval_interval, log_interval, expected
):
    trainer = train(tmp_path, max_duration=max_duration, log_interval=log_interval,
                    checkpoint_interval=None, eval_interval=eval_interval)
    lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [(r["kind"], r["step"]) for r in map(json.loads, lines)] == expected


def test_a_checkpoint_at_the_runs_end_writes_its_last_interval_before_it(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "FLUSH_S", 3600.0)
    seen = []
    # At fit_end an algorithm runs before the metrics log's own fit_end: what is on disk
    # then was written by the last checkpoint (at the epoch's end, step 4).
    probe = Probe(fit_end=lambda state: seen.append(train_steps_on_disk(tmp_path / "run")))
    train(tmp_path, [probe], max_duration="1ep", log_interval=3, checkpoint_interval="1ep", eval_interval=None)
    assert seen == [[3, 4]]


def test_with_no_wait_each_record_is_on_disk_when_made(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "FLUSH_S", 0.0)
    seen = []
    train(tmp_path, [watcher(tmp_path, seen)], max_duration="4ba", log_interval=1,
          checkpoint_interval=None, eval_interval=None)
    assert [len(s) for s in seen] == [0, 1, 2, 3]


def test_an_evaluation_writes_the_records_made_before_it_then_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "FLUSH_S", 3600.0)
    seen = []
    trainer = train(tmp_path, [watcher(tmp_path, seen)], max_duration="4ba", log_interval=1,
                    checkpoint_interval=None, eval_interval="2ba")
    # An evaluation first makes the train record of its step (at a batch_end it runs
    # before the metrics log's), then writes every record made, then its own.
    assert [len(s) for s in seen] == [0, 0, 2, 2]
    lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    order = [(r["kind"], r["step"]) for r in map(json.loads, lines)]
    assert order == [("train", 1), ("train", 2), ("eval", 2), ("train", 3), ("train", 4), ("eval", 4)]


@pytest.mark.parametrize("eval_interval", ["4ba", "1ep"])
def test_records_count_the_epochs_done_at_their_step_whichever_hook_makes_them(tmp_path, eval_interval):
    # 4 batches an epoch: step 4 ends epoch 0, whether evaluated at its batch_end or epoch_end.
    trainer = train(tmp_path, max_duration="8ba", log_interval=2, checkpoint_interval=None,
                    eval_interval=eval_interval)
    lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    epochs = {(r["kind"], r["step"]): r["epoch"] for r in map(json.loads, lines)}
    assert epochs == {("train", 2): 0, ("train", 4): 1, ("eval", 4): 1, ("train", 6): 1, ("train", 8): 2,
                      ("eval", 8): 2}
    assert trainer.summary["epochs"] == 2


def test_a_failed_run_writes_the_records_it_made(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "FLUSH_S", 3600.0)

    def fail_at_4(state):
        if state.timestamp.batch == 3:  # the fourth batch, before its step
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        train(tmp_path, [Probe(batch_start=fail_at_4)], max_duration="6ba", log_interval=1,
              checkpoint_interval=None, eval_interval=None)
    assert train_steps_on_disk(tmp_path / "run") == [1, 2, 3]


def test_records_that_cannot_be_written_at_a_failure_do_not_hide_its_error(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "FLUSH_S", 3600.0)

    def disk_full(record):
        raise OSError(errno.ENOSPC, "No space left on device")

    def fail_at_2(state):
        if state.timestamp.batch == 2:
            monkeypatch.setattr(metrics, "strict_json", disk_full)  # the disk fills up
            raise RuntimeError("boom")

    with pytest.warns(UserWarning, match="metrics.jsonl were not written: .*the disk is full"):
        with pytest.raises(RuntimeError, match="boom"):
            train(tmp_path, [Probe(batch_start=fail_at_2)], max_duration="6ba", log_interval=1,
                  checkpoint_interval=None, eval_interval=None)


def test_loggers_get_the_records_at_the_flush_in_order(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "FLUSH_S", 3600.0)

    class Logger(Probe):
        name = "logger"

        def __init__(self):
            super().__init__()
            self.told = []  # (the step the run was at, the record's step)

        @hookimpl
        def log_metrics(self, state, record):
            self.told.append((state.timestamp.batch, record["kind"], record["step"]))

    logger = Logger()
    train(tmp_path, [logger], max_duration="4ba", log_interval=1, checkpoint_interval="2ba",
          eval_interval=None)
    # Told of steps 1-2 at the checkpoint of step 2, of 3-4 at the end.
    assert logger.told == [(2, "train", 1), (2, "train", 2), (4, "train", 3), (4, "train", 4)]


def test_image_size_is_recorded_for_image_batches_only(tmp_path):
    features = DataLoader(TensorDataset(torch.randn(16, 32), torch.randint(0, 4, (16,))), batch_size=8)
    model = torch.nn.Linear(32, 4)
    trainer = Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), train_data=features,
                      max_duration="2ba", run_dir=tmp_path / "vectors", device="cpu", log_interval=1,
                      eval_interval=None, checkpoint_interval=None, progress_bar=False, verbose=False)
    trainer.fit()
    lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["image_size"] for line in lines] == [None, None]  # not [8, 32]
    images = train(tmp_path, [], max_duration="1ba", log_interval=1, checkpoint_interval=None, eval_interval=None)
    record = json.loads((images.run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert record["image_size"] == [16, 16]


def test_the_first_record_after_a_resume_averages_the_same_batches(tmp_path):
    """Issue 44 ("less often"): log_interval 2, resumed from a checkpoint at batch 3: the
    record at batch 4 averaged batch 4 alone; an uninterrupted run's averages 3 and 4."""

    def records(run_dir):
        lines = (run_dir / "run" / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"}

    common = dict(log_interval=2, eval_interval=None, seed=3)
    train(tmp_path / "straight", max_duration="6ba", checkpoint_interval=None, **common)
    armed = [True]

    def killed_at_4(state):
        if armed[0] and state.timestamp.batch == 3:  # the fourth batch, after the checkpoint at batch 3
            armed[0] = False
            raise KeyboardInterrupt  # as a kill: no record made for the open window

    split = dict(max_duration="6ba", checkpoint_interval="3ba", autoresume=True, **common)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "split", [Probe(batch_start=killed_at_4)], **split)
    train(tmp_path / "split", [Probe(batch_start=killed_at_4)], **split)
    straight, resumed = records(tmp_path / "straight"), records(tmp_path / "split")
    assert sorted(straight) == sorted(resumed) == [2, 4, 6]
    assert resumed[4] == pytest.approx(straight[4], rel=1e-12)
    assert resumed == pytest.approx(straight, rel=1e-12)
