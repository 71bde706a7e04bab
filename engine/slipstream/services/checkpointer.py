"""Write checkpoints at an interval and at the end of the run.

Files go to ``RUN_DIR/checkpoints/ep{E}-ba{B}.pt``; the newest is also
``latest.pt``. ``best.pt`` is written at each evaluation that improves the
monitored metric (``best_metric``: any evaluated metric, better as its plugin's
``higher_is_better`` says: eval ``accuracy`` higher, eval ``loss`` lower) and records
it under ``"best"`` (metric, value, step, epoch); every checkpoint names that metric and its
direction under ``"ranked_by"``. A checkpoint written after an evaluation of its step holds that
evaluation's metrics under ``"eval"`` (step, epoch, loss, accuracy, ...). The last
``keep`` interval checkpoints are kept, and with ``keep_best`` also the ``keep_best``
best by ``best_metric`` among those evaluated at their step (what
``slipstream average --best N`` averages); older ones are deleted. Only rank 0
writes. Without an interval nothing is written. A checkpoint whose weights are not
all finite is never written, so ``latest.pt`` and ``best.pt`` stay the last good ones.

When the model's or optimizer's state is sharded (DTensors, from a parallelism
plugin's ``state_dicts``), every rank writes its shards with
torch.distributed.checkpoint into ``ep{E}-ba{B}.dcp/`` beside the file, which then
names that folder instead of holding the tensors. ``best.pt`` is not kept for
sharded checkpoints (its shards would need a folder of their own): a warning says so.
"""

from __future__ import annotations

import math
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slipstream.duration import Duration
from slipstream.errors import CheckpointError
from slipstream.hookspecs import hookimpl
from slipstream.interval import RunInterval
from slipstream.run.checkpoint import (
    load_checkpoint,
    local_tensors,
    nonfinite_tensors,
    save_checkpoint,
    save_shards,
    sharded_parts,
)
from slipstream.run.directory import RunDir
from slipstream.state import State


# The metrics best.pt may monitor, and whether higher is better.
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
        best_metric: str | None = "accuracy",
        keep_best: int = 0,
        best_higher: bool = True,
    ) -> None:
        self.paths = RunDir(Path(run_dir))
        self.build_payload = build_payload
        # Asked before each save (the divergence check); False means do not save.
        self.guard = guard
        self.interval = RunInterval(interval)
        self.keep = keep
        self.keep_best = keep_best
        self.write = write
        self._written: list[Path] = []
        self._steps: dict[Path, int] = {}  # the step of each interval checkpoint in _written
        # best_metric's value at each evaluated step, for keep_best; and the last
        # evaluation's record, which a checkpoint of the same step carries.
        self._values: dict[int, float] = {}
        self._evaluated: dict[str, Any] | None = None
        self._last_saved_batch: int | None = None
        self.best_metric = best_metric  # checked with the run's metrics
        self.best_higher = best_higher  # the metric's higher_is_better
        self.best: dict[str, Any] | None = None  # what best.pt holds: metric, value, step, epoch

    @hookimpl
    def fit_start(self, state: State) -> None:
        self.interval.start(state)
        if state.timestamp.batch > 0 and self.write:
            # A resumed run counts the interval checkpoints the run before it left
            # (up to its step) against checkpoint_keep: each requeue would otherwise
            # leave up to `keep` more behind.
            found = [(step, path) for step, path in self.paths.interval_checkpoints() if step <= state.timestamp.batch]
            self._written = [path for _, path in found]
            self._steps = {path: step for step, path in found}
            if self.keep_best and self.best_metric is not None:
                from slipstream.run.average import evaluated_values

                values = evaluated_values(self.paths, self.best_metric)
                self._values = {step: v for step, v in values.items() if step <= state.timestamp.batch}
        if state.timestamp.batch > 0 and self.paths.best.is_file():
            # A resumed run: the best so far is the one best.pt holds.
            try:
                saved = load_checkpoint(self.paths.best).get("best")
            except CheckpointError:
                saved = None
            step = saved.get("step") if isinstance(saved, dict) else None
            if isinstance(step, int) and step > state.timestamp.batch:
                self._set_aside_best(state, step)
            elif isinstance(saved, dict) and saved.get("metric") == self.best_metric:
                self.best = saved
                state.summary["best_checkpoint"] = saved
            elif isinstance(saved, dict) and saved.get("metric") and self.write:
                self._keep_other_best(saved)

    def _keep_other_best(self, saved: dict[str, Any]) -> None:
        """best.pt of another best_metric (changed on resume): its weights are the best
        of what the run looked for until now, so they keep a name of their own rather
        than being replaced at the next evaluation by a best of the new metric."""
        aside = self.paths.best.with_name(f"best-{saved['metric']}-ba{saved.get('step')}.pt")
        self.paths.best.replace(aside)
        now = "no metric (trainer.best_metric=null)" if self.best_metric is None else self.best_metric
        warnings.warn(
            f"slipstream: checkpoints/best.pt was the best by {saved['metric']} ({saved.get('value')} at step "
            f"{saved.get('step')}); this run monitors {now}, so it is kept as {aside.name}",
            stacklevel=2,
        )

    def _set_aside_best(self, state: State, step: int) -> None:
        """best.pt of steps this resume discards (it resumes from an earlier checkpoint):
        kept under another name, never taken for this run's best."""
        if not self.write:
            return
        aside = self.paths.best.with_name(f"best-ba{step}-discarded.pt")
        self.paths.best.replace(aside)
        warnings.warn(
            f"slipstream: checkpoints/best.pt is from step {step}, past step {state.timestamp.batch} that this "
            f"run resumes from, so it is not this run's: it is kept as {aside.name}, and best.pt is written "
            "again at this run's next evaluation",
            stacklevel=2,
        )

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

    @hookimpl
    def eval_end(self, state: State) -> None:
        if not self.interval.enabled:
            return
        ts = state.timestamp
        self._evaluated = {"step": ts.batch, "epoch": state.epochs_done(), **state.eval_metrics}
        if self.best_metric is None:
            return
        value = state.eval_metrics.get(self.best_metric)
        # Eval metrics are the same on every rank (all-reduced): all ranks agree here.
        if value is None or not math.isfinite(value) or not math.isfinite(state.eval_metrics.get("loss", 0.0)):
            return
        self._values[ts.batch] = value
        if self.keep_best and self.write:  # the checkpoint of this step may be saved already
            self._prune(ts.batch)
        if self.best is not None:
            higher = self.best_higher
            if (value <= self.best["value"]) if higher else (value >= self.best["value"]):
                return
        best = {"metric": self.best_metric, "value": value, "step": ts.batch, "epoch": state.epochs_done()}
        payload = self._payload(state, shards=False)
        if payload is None:
            return
        if self.write:
            save_checkpoint({**payload, "best": best}, self.paths.best)
        self.best = best
        state.summary["best_checkpoint"] = best

    def _payload(self, state: State, shards: bool = True) -> dict[str, Any] | None:
        """What to save, or None when nothing may be saved: a diverged run, weights
        that are not all finite, or (without ``shards``) a sharded state."""
        if self.guard is not None and not self.guard(state):
            return None
        payload = self.build_payload(state)  # every rank: may hold collectives (FSDP)
        ts = state.timestamp
        sharded = sharded_parts({k: payload[k] for k in ("model", "optimizer")})
        if sharded and not shards:
            if self.best_metric is not None and self.write:
                warnings.warn(
                    "slipstream: checkpoints/best.pt is not kept for sharded checkpoints; "
                    "set trainer.best_metric=null to silence this",
                    RuntimeWarning,
                    stacklevel=3,
                )
            self.best_metric = None  # every rank alike: the state stays sharded
            return None
        if sharded:
            payload = self._save_shards(state, payload, sharded)
            if payload is None:
                return None
        if not self.write:
            return payload
        if self.best_metric is not None:
            # The metric's direction travels with each checkpoint: `slipstream average
            # --best` ranks by any metric without its plugin at hand.
            payload = {**payload, "ranked_by": {"metric": self.best_metric, "higher_is_better": self.best_higher}}
        if self._evaluated is not None and self._evaluated["step"] == ts.batch:
            payload = {**payload, "eval": self._evaluated}
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
                stacklevel=3,
            )
            return None
        return payload

    def save(self, state: State) -> Path | None:
        self._last_saved_batch = state.timestamp.batch
        payload = self._payload(state)
        if payload is None or not self.write:
            return None
        ts = state.timestamp
        if self.keep == 0 and not self.keep_best:  # none kept besides latest.pt: none written
            return save_checkpoint(payload, self.paths.latest)
        path = save_checkpoint(payload, self.paths.checkpoint(state.epochs_done(), ts.batch))
        save_checkpoint(payload, self.paths.latest)
        if path in self._written:  # the same step written again (a resume from before it)
            self._written.remove(path)
        self._written.append(path)
        self._steps[path] = ts.batch
        self._prune(ts.batch)
        return path

    def _prune(self, now: int) -> None:
        """Delete the interval checkpoints neither among the last ``keep`` nor among the
        ``keep_best`` best; one of step ``now`` not yet evaluated stays (the run's final
        evaluation comes after its last checkpoint)."""
        if self.keep < 0:
            return
        kept = set(self._written[max(0, len(self._written) - self.keep) :])
        if self.keep_best:
            higher = self.best_higher
            scored = [p for p in self._written if self._steps.get(p) in self._values]
            # The best first; of equal values the later step.
            scored.sort(key=lambda p: (self._values[self._steps[p]] * (1 if higher else -1), self._steps[p]))
            kept.update(scored[max(0, len(scored) - self.keep_best) :])
            kept.update(p for p in self._written if self._steps.get(p) == now and now not in self._values)
        for old in [p for p in self._written if p not in kept]:
            self._written.remove(old)
            self._steps.pop(old, None)
            old.unlink(missing_ok=True)
            shutil.rmtree(self.paths.shards_of(old), ignore_errors=True)

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
        folder = self.paths.shards(state.epochs_done(), ts.batch)
        save_shards({k: payload[k] for k in sharded}, folder)
        return {**payload, **dict.fromkeys(sharded), "shards": folder.name, "sharded_parts": sharded}
