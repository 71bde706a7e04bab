"""Write checkpoints at an interval and at the end of the run.

Files go to ``RUN_DIR/checkpoints/ep{E}-ba{B}.pt``; the newest is also
``latest.pt``. Only rank 0 writes. Without an interval nothing is written.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..checkpoint import save_checkpoint
from ..duration import Duration
from ..hookspecs import hookimpl
from ..state import State


class Checkpointer:
    name = "engine.checkpoint"

    def __init__(
        self,
        run_dir: Path,
        build_payload: Callable[[State], dict[str, Any]],
        interval: Duration | str | None = "1ep",
        keep: int = 2,
        write: bool = True,
    ) -> None:
        self.folder = Path(run_dir) / "checkpoints"
        self.build_payload = build_payload
        self.interval = Duration.parse(interval) if interval else None
        self.keep = keep
        self.write = write
        self._next: float | None = None
        self._written: list[Path] = []
        self._last_saved_batch: int | None = None

    @hookimpl
    def fit_start(self, state: State) -> None:
        if self.interval is not None:
            now = state.time_in(self.interval.unit)
            self._next = (now // self.interval.value + 1) * self.interval.value

    def _due(self, state: State) -> bool:
        if self.interval is None or self._next is None:
            return False
        now = state.time_in(self.interval.unit)
        if now + 1e-9 < self._next:
            return False
        while now + 1e-9 >= self._next:
            self._next += self.interval.value
        return True

    @hookimpl
    def batch_end(self, state: State) -> None:
        if self.interval is not None and self.interval.unit != "ep" and self._due(state):
            self.save(state)

    @hookimpl
    def epoch_end(self, state: State) -> None:
        if self.interval is not None and self.interval.unit == "ep" and self._due(state):
            self.save(state)

    @hookimpl
    def fit_end(self, state: State) -> None:
        # No interval means no checkpoints at all, not "only the last one".
        if self.interval is not None and self._last_saved_batch != state.timestamp.batch:
            self.save(state)

    def save(self, state: State) -> Path | None:
        self._last_saved_batch = state.timestamp.batch
        payload = self.build_payload(state)  # every rank: may hold collectives later (FSDP)
        if not self.write:
            return None
        ts = state.timestamp
        path = save_checkpoint(payload, self.folder / f"ep{ts.epoch}-ba{ts.batch}.pt")
        save_checkpoint(payload, self.folder / "latest.pt")
        self._written.append(path)
        while self.keep >= 0 and len(self._written) > max(self.keep, 1):
            self._written.pop(0).unlink(missing_ok=True)
        return path
