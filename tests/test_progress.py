"""The progress bar refreshes by time, so it costs nothing per batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import train
from slipstream.services import progress


class FakeBar:
    """Stands in for tqdm and records what the progress bar asks of it."""

    made: list[FakeBar] = []

    def __init__(self, total=None, initial=0, **_) -> None:
        self.total, self.n = total, initial
        self.updates = 0
        self.postfix: dict = {}
        FakeBar.made.append(self)

    def update(self, n: int) -> None:
        self.updates += 1
        self.n += n

    def set_postfix(self, fields, refresh=True) -> None:
        self.postfix = dict(fields)

    def close(self) -> None:
        pass


@pytest.fixture
def fake_tqdm(monkeypatch):
    FakeBar.made = []
    monkeypatch.setattr(progress, "tqdm", FakeBar)
    return FakeBar.made


def test_the_bar_is_not_touched_every_batch(tmp_path: Path, fake_tqdm, monkeypatch) -> None:
    monkeypatch.setattr(progress, "REFRESH_S", 3600.0)
    train(tmp_path, max_duration="6ep", progress_bar=True)  # 24 batches
    (bar,) = fake_tqdm
    # The first batch draws, then nothing until the end of the run draws the final state.
    assert bar.updates == 2
    assert bar.n == bar.total == 24
    assert bar.postfix["ep"] == 6 and "acc" in bar.postfix


def test_with_no_interval_it_would_draw_every_batch(tmp_path: Path, fake_tqdm, monkeypatch) -> None:
    monkeypatch.setattr(progress, "REFRESH_S", 0.0)
    train(tmp_path, max_duration="6ep", progress_bar=True)
    (bar,) = fake_tqdm
    assert bar.updates == 24 + 1 and bar.n == 24
