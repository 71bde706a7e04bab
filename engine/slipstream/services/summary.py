"""``summary.json``: the run's outcome, written at the end (also when it fails).

Written atomically and durably, as strict JSON (a non-finite value becomes null and
is named in ``"nonfinite"``). Nothing is written for a run that failed before it
started (a bad checkpoint, a plugin's ``init``): such a start leaves no summary to
block the retry or to overwrite an earlier run's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..hookspecs import hookimpl
from ..rundir import SUMMARY, atomic_write_text, strict_json
from ..state import State


class SummaryWriter:
    name = "engine.summary"

    def __init__(
        self,
        run_dir: Path,
        build_summary: Callable[[State, str], dict[str, Any]],
        write: bool = True,
    ) -> None:
        self.path = Path(run_dir) / SUMMARY
        self.build_summary = build_summary
        self.write = write
        self.summary: dict[str, Any] = {}
        self._started = False

    def _write(self, state: State, status: str, error: BaseException | None = None) -> None:
        self.summary = self.build_summary(state, status)
        if state.stop_reason is not None:
            self.summary["stop_reason"] = state.stop_reason
        if error is not None:
            self.summary["error"] = f"{type(error).__name__}: {error}"
        if self.write and self._started:
            atomic_write_text(self.path, strict_json(self.summary, indent=2) + "\n")

    @hookimpl
    def fit_start(self, state: State) -> None:
        self._started = True

    @hookimpl
    def fit_end(self, state: State) -> None:
        self._write(state, state.stop_status or "completed")

    @hookimpl
    def exception(self, state: State, error: BaseException) -> None:
        # A second Ctrl-C (or SIGTERM) aborts with a KeyboardInterrupt: still an interruption.
        self._write(state, "interrupted" if isinstance(error, KeyboardInterrupt) else "failed", error)
