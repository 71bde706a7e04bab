"""The progress bar refreshes by time, so it costs nothing per batch: what it draws."""

from __future__ import annotations

import re
from pathlib import Path

from helpers import train
from slipstream.services import progress


def _drawn(text: str) -> list[int]:
    """The batch counts the bar showed, frame by frame (tqdm redraws with a carriage return)."""
    return [int(n) for n in re.findall(r"(\d+)/24 ", text)]


def test_the_bar_redraws_by_time_not_every_batch(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(progress, "REFRESH_S", 3600.0)
    train(tmp_path, max_duration="6ep", progress_bar=True)  # 24 batches
    err = capsys.readouterr().err
    # Drawn when it opens, at the first batch, then not until the end of the run.
    assert sorted(set(_drawn(err))) == [0, 1, 24]
    last = err.rstrip().split("\r")[-1]
    assert "24/24" in last and "ep=6" in last and "acc=" in last


def test_with_no_interval_it_draws_every_batch(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(progress, "REFRESH_S", 0.0)
    train(tmp_path, max_duration="6ep", progress_bar=True)
    assert sorted(set(_drawn(capsys.readouterr().err))) == list(range(25))
