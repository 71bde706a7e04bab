"""tensorboard: every metrics.jsonl record as scalars, read back with TensorBoard's
own event reader; hyper-parameters and final metrics at the end."""

from __future__ import annotations

import json

import pytest
from slipstream_tensorboard import TensorBoard, TensorBoardConfig, hparams

from helpers import train

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def load(folder):
    acc = event_accumulator.EventAccumulator(str(folder))
    acc.Reload()
    return acc


def test_scalars_match_metrics_jsonl_and_hparams_are_written(tmp_path):
    trainer = train(tmp_path, callbacks=[TensorBoard()], max_duration="2ep", log_interval=2)
    records = [json.loads(line) for line in trainer.paths.metrics.read_text().splitlines()]
    folder = trainer.run_dir / "tensorboard"
    acc = load(folder)
    for kind, key in (("train", "loss"), ("train", "lr"), ("eval", "accuracy"), ("eval", "loss")):
        expected = [(r["step"], r[key]) for r in records if r["kind"] == kind]
        logged = [(e.step, e.value) for e in acc.Scalars(f"{kind}/{key}")]
        assert [s for s, _ in logged] == [s for s, _ in expected]
        assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6)
    assert "train/image_size.0" in acc.Tags()["scalars"]
    # add_hparams writes the config and the final metrics in a run of their own.
    final = load(folder / "hparams")
    assert final.Scalars("final/accuracy")[0].value == pytest.approx(trainer.summary["accuracy"])


def test_nothing_without_the_callback(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # torch's SummaryWriter writes to ./runs unless told a folder
    trainer = train(tmp_path, max_duration="1ba")
    assert trainer.paths.metrics.read_text()  # the run logged its metrics, to metrics.jsonl only
    assert not list(tmp_path.rglob("events.out.tfevents.*"))
    assert not (trainer.run_dir / "tensorboard").exists() and not (tmp_path / "runs").exists()


def test_log_dir_and_hparams_values(tmp_path):
    train(tmp_path, callbacks=[TensorBoard(TensorBoardConfig(log_dir=str(tmp_path / "tb")))], max_duration="1ba")
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert hparams({"a": {"b": [1, 2]}, "c": None}) == {"a.b": "[1, 2]", "c": "null"}
