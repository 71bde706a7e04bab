"""One "every N" rule for evaluation, checkpoints, logging and progress
(:mod:`slipstream.interval`), fractional epochs included."""

from __future__ import annotations

import json

import pytest

from helpers import train
from slipstream.interval import Interval


def _records(trainer, kind: str) -> list[tuple[int, int]]:
    lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["epoch"]) for r in map(json.loads, lines) if r["kind"] == kind]


# tiny_loaders: 4 batches an epoch.
@pytest.mark.parametrize(
    ("interval", "duration", "expected"),
    [
        ("0.5ep", "2ep", [(2, 0), (4, 1), (6, 1), (8, 2)]),  # was [(4, 1), (8, 2)]: whole epochs only
        ("1.5ep", "3ep", [(6, 1), (12, 3)]),
        ("1ep", "2ep", [(4, 1), (8, 2)]),  # an epoch's end evaluates at epoch_end, as before
        ("3ba", "2ep", [(3, 0), (6, 1), (8, 2)]),  # and once more at the end of the run
    ],
)
def test_evaluation_follows_fractional_epoch_intervals(tmp_path, interval, duration, expected):
    trainer = train(tmp_path, [], max_duration=duration, eval_interval=interval, checkpoint_interval=None)
    assert _records(trainer, "eval") == expected


def test_checkpoints_follow_fractional_epoch_intervals(tmp_path):
    trainer = train(
        tmp_path, [], max_duration="2ep", eval_interval=None, checkpoint_interval="0.5ep", checkpoint_keep=10
    )
    names = sorted(p.name for p in (trainer.run_dir / "checkpoints").iterdir())
    assert names == ["ep0-ba2.pt", "ep1-ba4.pt", "ep1-ba6.pt", "ep2-ba8.pt", "latest.pt"]


def test_logging_every_n_batches_continues_after_a_resume(tmp_path):
    first = train(tmp_path / "a", [], max_duration="5ba", log_interval=3, eval_interval=None, checkpoint_interval="5ba")
    assert [step for step, _ in _records(first, "train")] == [3, 5]  # and the last batch
    resumed = train(
        tmp_path / "a",
        [],
        max_duration="8ba",
        log_interval=3,
        eval_interval=None,
        checkpoint_interval=None,
        load_path=first.run_dir / "checkpoints" / "latest.pt",
    )
    # The marks of the run it continues (6), not 3 batches after the resume (8).
    assert [step for step, _ in _records(resumed, "train")] == [3, 5, 6, 8]


def test_an_interval_is_due_once_however_many_marks_passed():
    every = Interval(2.0)
    assert not every.due(1.5)
    assert every.due(7.0)  # 2, 4 and 6 passed in one long step: due once
    assert (every.due(7.9), every.due(8.0)) == (False, True)
    # Marks after an origin (the progress bar's clock), due at once when asked.
    redraw = Interval(0.5, origin=100.0, next=100.0)
    assert [redraw.due(t) for t in (100.0, 100.2, 100.5, 100.6, 101.1)] == [True, False, True, False, True]
    assert all(Interval(0.0).due(t) for t in (0.0, 0.0, 1.0))  # every 0: always


def test_an_interval_resumes_on_the_marks_of_the_run():
    every = Interval.after(0.5, 1.0)  # resumed exactly at a mark: wait for the next
    assert (every.due(1.25), every.due(1.5)) == (False, True)


# 4 batches an epoch of 16 samples: the first batch count at which each duration is done.
@pytest.mark.parametrize(("total", "done_at"), [("2ep", 8), ("1.5ep", 6), ("6ba", 6), ("100sp", 7)])
def test_is_done_agrees_with_the_run_time_in_its_unit(total, done_at):
    import torch

    from slipstream.duration import Duration
    from slipstream.state import State

    model = torch.nn.Linear(2, 2)
    state = State(model, torch.optim.SGD(model.parameters(), lr=0.1), Duration.parse(total), batches_per_epoch=4)
    for batch in range(13):
        ts = state.timestamp
        ts.epoch, ts.batch_in_epoch, ts.batch, ts.samples = batch // 4, batch % 4, batch, 16 * batch
        assert state.is_done() == (batch >= done_at), (total, batch)
    state.timestamp.batch = state.timestamp.epoch = state.timestamp.batch_in_epoch = state.timestamp.samples = 0
    assert not state.is_done()
    state.request_stop("interrupted", "a signal")
    assert state.is_done()
