"""``metrics.jsonl``: one train record per logging interval, one eval record per
evaluation. The loss of each batch is kept on the device (by
:class:`~slipstream.services.losses.TrainLosses`) and read once per interval, so
the loop never waits for the device in between.

Records are strict JSON: a NaN or infinite value is written as null and named in
the record's ``"nonfinite"`` list. A resumed run first drops the records past the
step it resumes from, so the log reads as one run. Rates (samples/s, MFU) are per
second of training: the run's clock, with evaluation taken out.

Each record written is handed to the ``log_metrics`` hook as the line parsed back,
so every logger plugin sees exactly what the file holds.

Records are made at their interval but serialised and written together, at most
every ``flush_s`` seconds (1 by default) and always before an evaluation's record,
a checkpoint, the end of the run or its failure. Between the steps of a small model
formatting and writing a line costs tens of microseconds (at a record a batch the
engine cost 1.21x a hand-written loop, and 1.13x with this and the cheaper read of
the losses: ``benchmarks/bench_overhead.py --log-interval 1``). So a reader
following the file is at most a second behind, and a process killed outright loses
at most that second of train records, never one before a checkpoint it wrote.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from slipstream.errors import describe_os_error
from slipstream.hookspecs import hookimpl
from slipstream.interval import Interval
from slipstream.run.directory import METRICS, atomic_write_text, strict_json
from slipstream.services.losses import TrainLosses
from slipstream.services.utilization import Utilization
from slipstream.state import State

# Seconds a record made at its interval may wait to be written with the next ones.
FLUSH_S = 1.0


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) else value


def truncate_log(path: Path, step: int) -> int:
    """Keep the records of ``path`` up to ``step``; drop later ones and any line a
    crash cut short. Returns how many lines were dropped."""
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            keep = isinstance(record, dict) and int(record.get("step", 0)) <= step
        except (ValueError, TypeError):
            keep = False
        if keep:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        atomic_write_text(path, "".join(kept))
    return dropped


class MetricsLogger:
    name = "engine.metrics"

    def __init__(
        self,
        run_dir: Path | None,
        log_interval: int = 20,
        write: bool = True,
        utilization: Utilization | None = None,
        hooks: Any = None,
        losses: TrainLosses | None = None,
        flush_s: float | None = None,
    ) -> None:
        """``losses``: the keeper of the batches' losses (None: no train records, only
        eval ones). ``flush_s``: the longest a made record waits to be written (0:
        each is written when made; None: :data:`FLUSH_S`)."""
        self.path = Path(run_dir) / METRICS if run_dir is not None and write else None
        # The plugin manager's hook relay, for log_metrics (None: nobody is told).
        self.hooks = hooks
        self.log_interval = log_interval
        self._every = Interval(log_interval)
        self.utilization = utilization
        self._flops_at_last: float | None = 0.0
        self._file: Any = None
        self.losses = losses
        self._samples_at_last = 0
        self._time_at_last = 0.0
        self._eval_started: float | None = None
        self.flush_s = FLUSH_S if flush_s is None else flush_s
        self._pending: list[dict[str, Any]] = []
        self._state: State | None = None  # the run's, for log_metrics at a flush
        self._flush_at = 0.0
        self._listened = True
        # The last train and eval record made, for the progress bar and the target.
        self.last: dict[str, dict[str, Any]] = {}
        # The LRs (one per parameter group) the last step trained with, set by the loop
        # when a scheduler has moved the optimizer's since (None: the optimizer's own
        # are the ones it trained with).
        self.lr_used: list[float] | None = None

    @hookimpl
    def fit_start(self, state: State) -> None:
        self.last = {}
        if self.path is not None:
            if self.path.is_file():  # a resumed run: its log continues from here
                truncate_log(self.path, state.timestamp.batch)
            self._file = self.path.open("a", buffering=1)
        self._state = state
        # Asked once: a logger registers at init at the latest.
        self._listened = self.hooks is not None and self._listened_to()
        self._flush_at = time.monotonic() + self.flush_s
        self._every = Interval.after(self.log_interval, state.timestamp.batch)
        self._samples_at_last = state.timestamp.samples
        self._time_at_last = state.tick()
        self._flops_at_last = self._flops()

    @hookimpl
    def batch_end(self, state: State) -> None:
        # One comparison on most batches. The run's last interval, when it ends
        # between marks, is logged by log_final: before the final evaluation or
        # checkpoint, else at fit_end.
        step = state.timestamp.batch
        if self._every.due(step):
            self.log_train(state)

    def log_final(self, state: State) -> None:
        """Log the losses since the last record if this is the run's last batch, so
        the final train record comes before what the run's end writes after it."""
        if state.is_done():
            self.log_train(state)

    def log_train(self, state: State) -> None:
        loss = self.losses.take_mean(state) if self.losses is not None else None  # the one sync
        if loss is None:
            return
        now = state.tick()  # after the sync, so the interval holds the device's work
        seconds = max(now - self._time_at_last, 1e-9)
        samples = state.timestamp.samples - self._samples_at_last
        flops = self._flops()
        done = None if flops is None or self._flops_at_last is None else flops - self._flops_at_last
        inputs = state.batch[0] if state.batch is not None else None
        lrs = self.lr_used if self.lr_used is not None else [g["lr"] for g in state.optimizer.param_groups]
        record = {
            "kind": "train",
            "step": state.timestamp.batch,
            "epoch": state.epochs_done(),
            "elapsed_s": round(now, 4),
            "loss": loss,
            "lr": _scalar(lrs[0]) if lrs else None,
            # Of an image batch (N, C, H, W) only: the last two sizes of other inputs
            # (a batch of feature vectors) are not an image's.
            "image_size": list(inputs.shape[-2:]) if isinstance(inputs, torch.Tensor) and inputs.dim() == 4 else None,
            "samples_per_s": samples / seconds,
            "mfu": self.utilization.mfu(state, done, seconds) if self.utilization else None,
        }
        if len(set(lrs)) > 1:  # `lr` is the first group's (the backbone's with backbone_lr_scale)
            record["lr_groups"] = [_scalar(lr) for lr in lrs]
        if state.metrics:
            record.update({key: _scalar(value) for key, value in state.metrics.items()})
        self._write(dict(record))  # its own copy: the file gets what was made now
        self.last["train"] = record
        self._samples_at_last, self._time_at_last = state.timestamp.samples, state.tick()
        self._flops_at_last = flops

    def _flops(self) -> float | None:
        return self.utilization.flops if self.utilization is not None else None

    @hookimpl
    def eval_start(self, state: State) -> None:
        # The losses of the steps up to this evaluation, in a train record before its
        # eval record (an evaluation at batch_end runs before this logger's batch_end).
        self.log_train(state)
        self._eval_started = state.tick()

    @hookimpl
    def eval_end(self, state: State) -> None:
        record = {
            "kind": "eval",
            "step": state.timestamp.batch,
            "epoch": state.epochs_done(),
            "elapsed_s": round(state.tick(), 4),
            **state.eval_metrics,
        }
        self._write({k: _scalar(v) for k, v in record.items()}, now=True)
        self.last["eval"] = record
        # Evaluation time is not training throughput: take it out of the interval
        # (the interval's samples are kept, so the rate stays per training second).
        if self._eval_started is not None:
            self._time_at_last += state.tick() - self._eval_started
            self._eval_started = None

    def _write(self, record: dict[str, Any], *, now: bool = False) -> None:
        """Keep ``record`` for the next flush; flush when one is due or ``now``."""
        if self._file is None:
            return
        self._pending.append(record)
        if now or time.monotonic() >= self._flush_at:
            self.flush()

    def flush(self) -> None:
        """Write the records made since the last flush, and tell the loggers."""
        self._flush_at = time.monotonic() + self.flush_s
        if not self._pending or self._file is None:
            return
        lines = [strict_json(record) for record in self._pending]
        self._pending = []
        try:
            self._file.write("\n".join(lines) + "\n")
        except OSError as exc:
            # A file object's write names no file: the message must say which one.
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None
        if self._listened:
            for line in lines:
                self.hooks.log_metrics(state=self._state, record=json.loads(line))

    def _listened_to(self) -> bool:
        # The line is parsed back (so a logger sees what the file holds) only when a
        # logger implements log_metrics; a relay that is not pluggy's is always told.
        implementations = getattr(self.hooks.log_metrics, "get_hookimpls", None)
        return implementations is None or bool(implementations())

    @hookimpl
    def fit_end(self, state: State) -> None:
        # The last interval, unless an evaluation or checkpoint at the end logged it.
        self.log_train(state)
        self.close()

    @hookimpl
    def exception(self, state: State) -> None:
        # The run's own error is what the user must see: records that cannot be
        # written now (on the disk that filled up and failed the run) are told, not
        # raised over it.
        try:
            self.close()
        except OSError as exc:
            warnings.warn(
                f"slipstream: the last records of {METRICS} were not written: {describe_os_error(exc)}",
                stacklevel=2,
            )

    def close(self) -> None:
        if self._file is None:
            return
        try:
            self.flush()
        finally:
            file, self._file = self._file, None
            file.close()
