"""``summary.json``: the run's outcome, written at the end (also when it fails)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..hookspecs import hookimpl
from ..state import State


class SummaryWriter:
    name = "engine.summary"

    def __init__(
        self,
        run_dir: Path,
        build_summary: Callable[[State, str], dict[str, Any]],
        write: bool = True,
    ) -> None:
        self.path = Path(run_dir) / "summary.json"
        self.build_summary = build_summary
        self.write = write
        self.summary: dict[str, Any] = {}

    def _write(self, state: State, status: str, error: BaseException | None = None) -> None:
        self.summary = self.build_summary(state, status)
        if error is not None:
            self.summary["error"] = f"{type(error).__name__}: {error}"
        if self.write:
            tmp = self.path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.summary, indent=2, default=str) + "\n")
            tmp.replace(self.path)

    @hookimpl
    def fit_end(self, state: State) -> None:
        self._write(state, "interrupted" if state.summary.get("interrupted_by") else "completed")

    @hookimpl
    def exception(self, state: State, error: BaseException) -> None:
        self._write(state, "failed", error)
