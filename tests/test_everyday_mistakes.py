"""Everyday work done as a practitioner does it, where the engine was wrong without a
word or lost something (session 20's walkthrough): resumes, interrupts, eval output,
exports, overwrite, odd image files."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import tiny_loaders, tiny_model
from slipstream import Callback, CheckpointError, ConfigError, Trainer, hookimpl
from slipstream.cli import main as cli_main
from slipstream.run.checkpoint import batch_size_changed, load_checkpoint, save_checkpoint


def _trainer(run_dir: Path, **kwargs) -> Trainer:
    train, val = tiny_loaders(n=32, batch_size=8)
    model = tiny_model()
    kwargs = {"max_duration": "4ba", "progress_bar": False, "verbose": False, "device": "cpu", **kwargs}
    return Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), train_data=train,
                   eval_data=val, run_dir=run_dir, **kwargs)


class _SignalAt(Callback):
    """Sends SIGTERM to this process as batch ``at`` starts (a scheduler's preemption)."""

    name = "signal_at"

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    @hookimpl
    def batch_start(self, state) -> None:
        if state.timestamp.batch + 1 == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_run_stopped_in_its_last_batch_is_finished_by_its_resume(tmp_path):
    run = tmp_path / "run"
    first = _trainer(run, max_duration="3ba", callbacks=[_SignalAt(3)], eval_interval="1ep").fit()
    assert first["status"] == "interrupted" and first["accuracy"] is None  # no final evaluation
    resumed = _trainer(run, max_duration="3ba", autoresume=True, eval_interval="1ep").fit()
    assert resumed["status"] == "completed" and resumed["accuracy"] is not None
    assert resumed["samples_per_s"] == first["samples_per_s"]  # the session that trained, not 0
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
    again = _trainer(run, max_duration="3ba", autoresume=True, eval_interval="1ep").fit()
    assert again["status"] == "completed"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in records if r["kind"] == "eval"] == [("eval", 3)]


def test_a_resume_evaluated_at_its_step_does_not_evaluate_it_again(tmp_path):
    run = tmp_path / "run"
    _trainer(run, max_duration="4ba", callbacks=[_SignalAt(4)], eval_interval="1ep").fit()  # 4 batches an epoch
    summary = _trainer(run, max_duration="4ba", autoresume=True, eval_interval="1ep").fit()
    assert summary["status"] == "completed" and summary["accuracy"] is not None
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [4]


def test_best_pt_of_discarded_steps_is_set_aside_on_an_earlier_resume(tmp_path):
    run = tmp_path / "run"
    _trainer(run, max_duration="4ba", checkpoint_interval="2ba", checkpoint_keep=-1, eval_interval=None).fit()
    early = run / "checkpoints" / "ep0-ba2.pt"
    later = load_checkpoint(run / "checkpoints" / "latest.pt")
    save_checkpoint({**later, "best": {"metric": "accuracy", "value": 1.0, "step": 4, "epoch": 1}},
                    run / "checkpoints" / "best.pt")
    with pytest.warns(UserWarning, match="best.pt is from step 4, past step 2 that this run resumes from"):
        summary = _trainer(run, max_duration="3ba", load_path=early, eval_interval="1ba").fit()
    assert (run / "checkpoints" / "best-ba4-discarded.pt").is_file()
    best = load_checkpoint(run / "checkpoints" / "best.pt")["best"]
    assert best["step"] == 3 and summary["best_checkpoint"]["step"] == 3


def test_a_mid_epoch_resume_at_another_batch_size_says_what_it_skips():
    state = SimpleNamespace(timestamp=SimpleNamespace(batch_in_epoch=3, epoch=0), global_batch_size=32)
    message = batch_size_changed(Path("latest.pt"), 1, 16, state)
    assert "starts at sample 96 of its order, not at sample 48" in message and "48 samples are skipped" in message
    assert batch_size_changed(Path("latest.pt"), 1, 32, state) is None  # the same size
    state.timestamp.batch_in_epoch = 0
    assert batch_size_changed(Path("latest.pt"), 1, 16, state) is None  # at an epoch's end: exact


def test_overwrite_never_deletes_the_checkpoint_a_fine_tuning_run_loads(tmp_path):
    run = tmp_path / "run"
    _trainer(run, max_duration="2ba", checkpoint_interval="1ep").fit()
    latest = run / "checkpoints" / "latest.pt"
    with pytest.raises(ConfigError, match="would delete .*latest.pt, the checkpoint this run loads its weights from"):
        _trainer(run, overwrite=True, load_path=latest, load_weights_only=True)
    assert latest.is_file()


def test_a_directory_without_a_checkpoint_says_where_it_looked(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint in .*checkpoints/latest.pt \\(a run directory\\)"):
        load_checkpoint(tmp_path)


def test_sixteen_bit_images_are_read_as_eight_bit(tmp_path):
    from slipstream.data.datasets import read_rgb
    from slipstream.data.decode import decode_rgb

    grey = (np.arange(16 * 16, dtype=np.uint16).reshape(16, 16) * 257).astype(np.uint16)
    Image.fromarray(grey).save(tmp_path / "g16.png")
    for image in (read_rgb(str(tmp_path / "g16.png")), decode_rgb((tmp_path / "g16.png").read_bytes(), "g16")):
        assert image.dtype == torch.uint8 and image.shape == (3, 16, 16)
        assert image.max() == 255 and image[0, 0, 1] == 1  # 257 of 65535 is 1 of 255


def test_ctrl_c_before_training_says_interrupted(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli_main._COMMANDS, "recipes", interrupted)
    assert cli_main.main(["recipes"]) == 130
    assert capsys.readouterr().err.strip() == "slipstream: interrupted"


def test_eval_prints_its_metrics_when_the_default_file_cannot_be_written(tmp_path, monkeypatch, capsys):
    from slipstream.run import directory, inference

    metrics = {"loss": 1.0, "accuracy": 0.5}
    monkeypatch.setattr(inference, "evaluate_checkpoint", lambda *args, **kwargs: metrics)

    def read_only(path, text):
        raise OSError(30, "Read-only file system", str(path))

    monkeypatch.setattr(directory, "atomic_write_text", read_only)
    assert cli_main.main(["eval", "--checkpoint", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == metrics
    assert "not written to" in captured.err and "give -o FILE" in captured.err
    assert cli_main.main(["eval", "--checkpoint", str(tmp_path), "-o", str(tmp_path / "x.json")]) != 0
    assert json.loads(capsys.readouterr().out) == metrics  # printed before the write failed
