"""`State`, the one mutable object every hook receives, and its `Timestamp`."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from slipstream.duration import Duration

# The statuses a plugin may end a run with (``failed`` is the engine's, for an error).
STOP_STATUSES = ("completed", "target_reached", "stopped_early", "interrupted", "diverged")


@dataclass
class Timestamp:
    """Where the run is. Counters are global (summed over data-parallel ranks for
    samples) so that a schedule reads the same at any world size."""

    epoch: int = 0  # completed epochs
    batch: int = 0  # completed training batches in the whole run
    batch_in_epoch: int = 0  # completed training batches in the current epoch
    samples: int = 0  # training samples seen, over all ranks
    optimizer_steps: int = 0  # optimizer steps taken (or skipped on inf/NaN)
    elapsed_s: float = 0.0  # wall-clock seconds of the run, resumed runs included

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, type(getattr(self, key))(value))


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module under any DDP/FSDP or torch.compile wrapper."""
    while True:
        if hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


@dataclass
class State:
    """Everything a plugin may read or change.

    Where the batch is at each event is documented on the event in
    :mod:`slipstream.hookspecs`. ``batch`` is ``(inputs, targets)`` on ``device``.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    max_duration: Duration
    train_loader: Any = None
    eval_loader: Any = None
    # Every evaluation set by name, the first being eval_loader (docs/metrics.md); empty: eval_loader as "val".
    eval_sets: dict[str, Any] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    loss_fn: Callable[..., torch.Tensor] = field(default_factory=nn.CrossEntropyLoss)
    schedulers: list[Any] = field(default_factory=list)
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    run_dir: Any = None
    config: dict[str, Any] = field(default_factory=dict)

    timestamp: Timestamp = field(default_factory=Timestamp)
    batches_per_epoch: int | None = None  # global batches in one epoch, when known
    global_batch_size: int | None = None

    # The current batch and what the loop made of it.
    batch: Any = None
    outputs: Any = None
    loss: torch.Tensor | None = None
    training: bool = True
    step_skipped: bool = False

    # The dtype the big kernels compute in, set by a precision plugin (None = the
    # parameters' own, fp32): MFU is measured against this dtype's peak.
    compute_dtype: torch.dtype | None = None
    # The memory format the model wants its 4-D inputs in. Any plugin may set it
    # (channels_last does, at init); the engine converts the batch to it once,
    # when it normalises the inputs after batch_start.
    input_memory_format: torch.memory_format = torch.contiguous_format
    # Set at init by a plugin that changes the training inputs' height and width
    # during the run (image_size_curriculum does), so that plugins specialising on
    # shapes (torch_compile) prepare for it without naming that plugin.
    varying_input_size: bool = False
    # What the FLOP counter (MFU) copies to the meta device in place of the model, set
    # at init by a plugin whose model cannot be copied once it has changed it (FSDP2
    # refuses deepcopy): `slipstream.services.flops.meta_copy` of the model just before.
    flops_model: nn.Module | None = None

    # The algorithms of this run, in their resolved order.
    algorithms: list[Any] = field(default_factory=list)
    # The callbacks of this run, in the order given.
    callbacks: list[Any] = field(default_factory=list)
    # Results of the last evaluation, by metric (evaluation.metrics; by default "loss",
    # "accuracy", and "accuracy_top5" when the model has at least 5 classes).
    eval_metrics: dict[str, float] = field(default_factory=dict)
    # Extra scalars for the next train record of metrics.jsonl (tensors allowed:
    # they are read only at the logging interval, so no per-step device sync).
    metrics: dict[str, Any] = field(default_factory=dict)
    # Extra fields for summary.json, by plugins (compile time, skipped steps, ...).
    summary: dict[str, Any] = field(default_factory=dict)
    # A scratch space per plugin, keyed by the plugin's name.
    stash: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Set by a plugin (or SIGTERM) to end the run cleanly after the current batch.
    stop_requested: bool = False
    # Why the run is stopping early, set with request_stop: the summary's status
    # ("interrupted", "diverged", ...) and a message for the user.
    stop_status: str | None = None
    stop_reason: str | None = None

    _clock_start: float = field(default_factory=time.perf_counter, repr=False)
    _elapsed_before: float = field(default=0.0, repr=False)
    _samples_before: int = field(default=0, repr=False)
    # The step this session started at (a resumed run's checkpoint step; else 0).
    session_start_batch: int = 0
    # Set by the trainer while processes share one clock (see tick).
    shared_clock: bool = False

    # -- model -----------------------------------------------------------------

    @property
    def unwrapped_model(self) -> nn.Module:
        return unwrap_model(self.model)

    # -- time ------------------------------------------------------------------

    def start_clock(self) -> None:
        """Start this session's clock where the timestamp stands (a resumed run
        continues its elapsed time and samples)."""
        self._elapsed_before = self.timestamp.elapsed_s
        self._samples_before = self.timestamp.samples
        self.session_start_batch = self.timestamp.batch
        self._clock_start = time.perf_counter()

    @property
    def session_elapsed_s(self) -> float:
        """Seconds of this session as of the last :meth:`tick`: the run's elapsed
        time less the sessions before a resume."""
        return self.timestamp.elapsed_s - self._elapsed_before

    @property
    def session_samples(self) -> int:
        """Training samples seen in this session (over all ranks)."""
        return self.timestamp.samples - self._samples_before

    def tick(self) -> float:
        """Refresh and return ``timestamp.elapsed_s`` (host clock: no device sync).

        With ``shared_clock`` (several processes whose run the wall clock decides), only
        the return value is this process's time: ``timestamp.elapsed_s``, by which the
        run decides, is set once a batch to the time all processes agreed on."""
        now = self._elapsed_before + time.perf_counter() - self._clock_start
        if not self.shared_clock:
            self.timestamp.elapsed_s = now
        return now

    @contextmanager
    def untimed(self) -> Iterator[None]:
        """Leave the time spent inside out of the run's clock: the engine's own
        bookkeeping (counting FLOPs for a new input size) is not training time."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self._clock_start += time.perf_counter() - started

    def time_in(self, unit: str) -> float:
        """The run's current time in ``unit`` (one of ep, ba, sp, dur, s).

        Epochs are fractional inside an epoch, so a schedule written in ``ep``
        still moves every batch.
        """
        ts = self.timestamp
        if unit == "ep":
            if self.batches_per_epoch:
                return ts.epoch + ts.batch_in_epoch / self.batches_per_epoch
            return float(ts.epoch)
        if unit == "ba":
            return float(ts.batch)
        if unit == "sp":
            return float(ts.samples)
        if unit == "s":
            return ts.elapsed_s
        if unit == "dur":
            return self.fraction_done()
        raise ValueError(f"unknown time unit {unit!r}; use one of ep, ba, sp, dur, s")

    def fraction_done(self) -> float:
        """How much of ``max_duration`` has passed, from 0 to 1."""
        total = self.max_duration
        return min(1.0, self.time_in(total.unit) / total.value) if total.value > 0 else 1.0

    def fraction_of_run(self, duration: Duration | str) -> float:
        """``duration`` expressed as a fraction of the whole run.

        Works across units where the conversion is known (epochs and batches
        through the batches per epoch); wall-clock durations convert only when the
        run itself is bounded by wall clock.
        """
        d = Duration.parse(duration)
        total = self.max_duration
        if d.unit == "dur":
            return d.value
        if d.unit == total.unit:
            return d.value / total.value
        in_batches = self._to_batches(d)
        total_batches = self._to_batches(total)
        if in_batches is None or total_batches is None:
            raise ValueError(
                f"cannot express {d} as a fraction of a run of {total}; "
                f"write it in 'dur' or in the run's unit ({total.unit})"
            )
        return in_batches / total_batches

    def _to_batches(self, d: Duration) -> float | None:
        if d.unit == "ba":
            return d.value
        if d.unit == "ep" and self.batches_per_epoch:
            return d.value * self.batches_per_epoch
        if d.unit == "sp" and self.global_batch_size:
            return d.value / self.global_batch_size
        return None

    def epochs_done(self) -> int:
        """The epochs completed at the current step, whichever hook asks: at an epoch's
        last ``batch_end`` it says what its ``epoch_end`` (where ``timestamp.epoch`` has
        moved on) says. Metrics records and checkpoint names count epochs so."""
        ts = self.timestamp
        ended = bool(self.batches_per_epoch) and ts.batch_in_epoch >= self.batches_per_epoch
        return ts.epoch + 1 if ended else ts.epoch

    def is_done(self) -> bool:
        return (
            self.stop_requested or self.time_in(self.max_duration.unit) >= self.max_duration.value
        )

    def request_stop(self, status: str, reason: str) -> None:
        """End the run after the current batch with ``status`` in summary.json and
        ``reason`` told to the user (a plain ``stop_requested = True`` ends it as
        "completed")."""
        if status not in STOP_STATUSES:
            raise ValueError(
                f"request_stop: status {status!r} is not one a run can end with; use one of "
                f"{', '.join(STOP_STATUSES)} (docs/run-directory.md, 'How a run ends')"
            )
        self.stop_requested = True
        self.stop_status = status
        self.stop_reason = reason
