"""Write checkpoints at an interval and at the end of the run.

Files go to ``RUN_DIR/checkpoints/ep{E}-ba{B}.pt``; the newest is also
``latest.pt``. Only rank 0 writes. Without an interval nothing is written. A
checkpoint whose weights are not all finite is never written, so ``latest.pt``
stays the last good one.

When the model's or optimizer's state is sharded (DTensors, from a parallelism
plugin's ``state_dicts``), every rank writes its shards with
torch.distributed.checkpoint into ``ep{E}-ba{B}.dcp/`` beside the file, which then
names that folder instead of holding the tensors.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint import local_tensors, nonfinite_tensors, save_checkpoint, save_shards, sharded_parts
from ..duration import Duration
from ..hookspecs import hookimpl
from ..interval import RunInterval
from ..rundir import RunDir
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
        guard: Callable[[State], bool] | None = None,
    ) -> None:
        self.paths = RunDir(Path(run_dir))
        self.folder = self.paths.checkpoints
        self.build_payload = build_payload
        # Asked before each save (the divergence check); False means do not save.
        self.guard = guard
        self.interval = RunInterval(interval)
        self.keep = keep
        self.write = write
        self._written: list[Path] = []
        self._last_saved_batch: int | None = None

    @hookimpl
    def fit_start(self, state: State) -> None:
        self.interval.start(state)

    @hookimpl
    def batch_end(self, state: State) -> None:
        if self.interval.due_at_batch_end(state):
            self.save(state)

    @hookimpl
    def epoch_end(self, state: State) -> None:
        if self.interval.due_at_epoch_end(state):
            self.save(state)

    @hookimpl
    def fit_end(self, state: State) -> None:
        # No interval means no checkpoints at all, not "only the last one".
        if self.interval.enabled and self._last_saved_batch != state.timestamp.batch:
            self.save(state)

    def save(self, state: State) -> Path | None:
        self._last_saved_batch = state.timestamp.batch
        if self.guard is not None and not self.guard(state):
            return None
        payload = self.build_payload(state)  # every rank: may hold collectives (FSDP)
        ts = state.timestamp
        sharded = sharded_parts({k: payload[k] for k in ("model", "optimizer")})
        if sharded:
            payload = self._save_shards(state, payload, sharded)
            if payload is None:
                return None
        if not self.write:
            return None
        bad = [] if sharded else nonfinite_tensors(payload["model"])
        if bad:
            kept = (
                f"{self.paths.latest} stays the last good one"
                if self.paths.latest.is_file()
                else "no checkpoint is written"
            )
            shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
            warnings.warn(
                f"slipstream: not writing the checkpoint of step {ts.batch}: the weights hold "
                f"NaN or infinity ({shown}); {kept}",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        path = save_checkpoint(payload, self.paths.checkpoint(ts.epoch, ts.batch))
        save_checkpoint(payload, self.paths.latest)
        self._written.append(path)
        while self.keep >= 0 and len(self._written) > max(self.keep, 1):
            old = self._written.pop(0)
            old.unlink(missing_ok=True)
            shutil.rmtree(self.paths.shards_of(old), ignore_errors=True)
        return path

    def _save_shards(
        self, state: State, payload: dict[str, Any], sharded: list[str]
    ) -> dict[str, Any] | None:
        """Every rank writes its shards of ``sharded`` parts; returns the payload that
        names the folder, or None (on every rank alike) when a shard is not finite."""
        ts = state.timestamp
        bad = nonfinite_tensors(local_tensors(payload["model"]))
        flag = torch.tensor([len(bad)], dtype=torch.int64)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag)  # all ranks skip together: the save is a collective
        if int(flag):
            if self.write:
                warnings.warn(
                    f"slipstream: not writing the checkpoint of step {ts.batch}: the weights hold "
                    "NaN or infinity",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return None
        folder = self.paths.shards(ts.epoch, ts.batch)
        save_shards({k: payload[k] for k in sharded}, folder)
        return {**payload, **dict.fromkeys(sharded), "shards": folder.name, "sharded_parts": sharded}
