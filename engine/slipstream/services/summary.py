"""``summary.json``: the run's outcome, written at the end (also when it fails).

Written atomically and durably, as strict JSON (a non-finite value becomes null and
is named in ``"nonfinite"``). Nothing is written for a run that failed before it
started (a bad checkpoint, a plugin's ``init``): such a start leaves no summary to
block the retry or to overwrite an earlier run's.

Throughput and MFU are this session's (a resumed run's earlier sessions left out),
per second of training: evaluation time is taken out.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from slipstream.errors import describe_os_error
from slipstream.hookspecs import hookimpl
from slipstream.plugins.dispatch import error_text
from slipstream.run.directory import SUMMARY, atomic_write_text, strict_json
from slipstream.run.versions import library_versions
from slipstream.services.peak_flops import device_label
from slipstream.services.target import TargetAccuracy
from slipstream.services.utilization import Utilization
from slipstream.state import State


class RunSummary:
    """Writes the run's ``summary.json`` (not torch's ``SummaryWriter``)."""

    name = "engine.summary"

    def __init__(
        self,
        run_dir: Path,
        algorithm_records: Callable[[], list[dict[str, Any]]],
        *,
        callback_records: Callable[[], list[dict[str, Any]]] = list,
        utilization: Utilization | None = None,
        target: TargetAccuracy | None = None,
        write: bool = True,
    ) -> None:
        """``algorithm_records`` / ``callback_records``: the run's algorithms and
        callbacks as checkpoints record them (name, version, distribution, config);
        the summary keeps them apart, so that it says which algorithms trained the model."""
        self.path = Path(run_dir) / SUMMARY
        self.algorithm_records = algorithm_records
        self.callback_records = callback_records
        self.utilization = utilization
        self.target = target
        self.write = write
        self.summary: dict[str, Any] = {}
        self._started = False
        # The summary of the session this one finishes without training (a run a signal
        # stopped in its last batch): its rates stand for the run's.
        self.carried: dict[str, Any] = {}

    def build(self, state: State, status: str) -> dict[str, Any]:
        """The summary of the run as it stands, with ``status``."""
        ts = state.timestamp
        # The clock as of now: the final evaluation (at fit_end, after the loop's last
        # tick) is in eval_time_s, so it must be in the elapsed time it is taken from.
        state.tick()
        train_s = max(state.session_elapsed_s - state.summary.get("eval_time_s", 0.0), 1e-9)
        utilization = self.utilization.summary(state, train_s) if self.utilization else {}
        # A diverged run's final weights are not what any evaluation measured: no
        # final accuracy (the best of earlier evaluations stays, with its checkpoint).
        final = {} if status == "diverged" else state.eval_metrics
        rates = {}
        if self.carried and not state.session_samples:
            rates = {key: self.carried[key] for key in CARRIED_RATES if key in self.carried}
        return {
            "status": status,
            "accuracy": final.get("accuracy"),
            "eval_loss": final.get("loss"),
            "wall_time_s": round(ts.elapsed_s, 3),
            "samples_per_s": state.session_samples / train_s,
            **utilization,
            "target_accuracy": self.target.target if self.target is not None else None,
            "target_metric": self.target.metric if self.target is not None else None,
            "time_to_target_s": self.target.reached_s if self.target is not None else None,
            "epochs": ts.epoch,
            "batches": ts.batch,
            "samples": ts.samples,
            "optimizer_steps": ts.optimizer_steps,
            "max_duration": str(state.max_duration),
            "algorithms": self.algorithm_records(),
            "callbacks": self.callback_records(),
            "versions": library_versions(),
            "device": str(state.device),
            "device_name": device_label(state.device),  # the GPU or CPU model
            "world_size": state.world_size,
            "threads": torch.get_num_threads(),
            "run_dir": str(state.run_dir),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            # After a resume the rates (samples_per_s, mfu, eval_time_s) are this
            # session's, which may have run on other hardware; the counts are the run's.
            **({"session_from_step": state.session_start_batch} if state.session_start_batch else {}),
            **state.summary,
            **rates,
        }

    @property
    def started(self) -> bool:
        """Whether the run got as far as ``fit_start`` (so that it has a summary)."""
        return self._started

    def _write(self, state: State, status: str, error: BaseException | None = None) -> None:
        self.summary = self.build(state, status)
        if state.stop_reason is not None:
            self.summary["stop_reason"] = state.stop_reason
        if error is not None:
            self.summary["error"] = error_text(error)  # with the plugin and hook that raised it
        if not (self.write and self._started):
            return
        try:
            atomic_write_text(self.path, strict_json(self.summary, indent=2) + "\n")
        except OSError as exc:
            if error is None:
                raise
            # The run's own error (often the same full disk) is what the user must
            # see: a summary that cannot be written now is told, not raised over it.
            warnings.warn(
                f"slipstream: {SUMMARY} was not written: {describe_os_error(exc)}", stacklevel=2
            )

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


# What a session that trained nothing takes from the one it finishes.
CARRIED_RATES = (
    "samples_per_s",
    "mfu",
    "compute_dtype",
    "peak_dtype",
    "peak_tflops",
    "peak_source",
    "train_flops_per_sample",
    "peak_memory_mb",
    "session_from_step",
)


def resume_summary(
    state: State, metrics: Path, target: TargetAccuracy | None = None, higher: Callable[[str], bool] | None = None
) -> None:
    """Make a resumed run's summary describe the whole run, as its metrics log does:
    the best accuracies (of every evaluation set, each metric in its direction,
    ``higher``) and the time the target was reached are taken from the eval
    records of ``metrics`` up to the checkpoint's step (what the log keeps on resume),
    and an evaluation at the checkpoint's step is the run's latest (``eval_metrics``)."""
    step = state.timestamp.batch
    evals = [r for r in _records(metrics) if r.get("kind") == "eval" and _num(r.get("step")) is not None]
    evals = [r for r in evals if r["step"] <= step]
    if evals and evals[-1]["step"] == step:
        last = {k: v for k, v in evals[-1].items() if k not in RECORD_KEYS}
        state.eval_metrics = {k: float(v) for k, v in last.items() if _num(v) is not None}
    if state.eval_sets:
        from slipstream.services.evaluation import keep_best_per_set

        for record in evals:
            values = {k: float(v) for k, v in record.items() if k not in RECORD_KEYS and _num(v) is not None}
            keep_best_per_set(state.summary, values, list(state.eval_sets), higher or (lambda key: True))
    for key, best_key in (("accuracy", "best_accuracy"), ("accuracy_top5", "best_accuracy_top5")):
        values = [v for r in evals if (v := _num(r.get(key))) is not None]
        if values:
            state.summary[best_key] = max(values + [state.summary.get(best_key) or 0.0])
    if target is not None and target.reached_s is None:
        for record in evals:
            value, elapsed = _num(record.get(target.metric)), _num(record.get("elapsed_s"))
            if elapsed is not None and target.reached(value):
                target.reached_s = elapsed
                break


# The keys of an eval record that are not metrics (services/metrics.py writes them).
RECORD_KEYS = ("kind", "step", "epoch", "elapsed_s", "nonfinite")


def _records(path: Path) -> list[dict[str, Any]]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash: the records around it still count
        if isinstance(record, dict):
            out.append(record)
    return out


def _num(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None

