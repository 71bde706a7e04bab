"""MFU and peak memory of every run.

MFU (model FLOPs utilisation) is the training FLOPs the model needs per second of
training, over the device's peak FLOP/s in the dtype the run computes in: the bf16
peak under bf16 autocast, fp32 otherwise (``state.compute_dtype``, which precision
plugins set), or tf32 for fp32 on CUDA's TF32 tensor cores (:func:`peak_name`).
FLOPs per sample are counted once per input size, on a meta copy of the model
(:mod:`slipstream.services.flops`), so an image-size curriculum is counted at each
size it uses; the count takes no training time (``state.untimed``) and changes
nothing in the run. The peak comes from :mod:`slipstream.services.peak_flops`,
probed in ``init``, before the run's clock starts.
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any

import torch

from slipstream.errors import ConfigError
from slipstream.hookspecs import hookimpl
from slipstream.services.flops import training_flops_per_sample
from slipstream.services.memory import PeakMemory
from slipstream.services.peak_flops import Peak, dtype_name, peak_flops, peak_name, raise_peak
from slipstream.state import State

_UNSEEN = object()  # equal to no shape


class Utilization:
    name = "engine.utilization"

    def __init__(
        self, peak_tflops: dict[str, float] | None = None, *, verbose: bool = False
    ) -> None:
        """``peak_tflops``: FLOP/s per dtype from :func:`slipstream.services.peak_flops.parse_peak_tflops`
        (None: probe the device, or read the cache)."""
        self.configured = peak_tflops
        self.verbose = verbose
        self.peak: Peak | None = None
        self.peak_name = "fp32"  # the peak MFU is measured against (set in init)
        self.memory: PeakMemory | None = None
        # Training FLOPs of this session on this process; None once a count failed,
        # since a partial count would understate MFU.
        self.flops: float | None = 0.0
        self.per_sample: dict[torch.Size, float] = {}
        self._last_shape: Any = _UNSEEN  # the last batch's shape, and its FLOPs
        self._last_flops = 0.0
        self.count_s = 0.0
        self.error: str | None = None

    @hookimpl
    def init(self, state: State) -> None:
        # Here, not in fit_start: init runs before the clock starts, and after the
        # algorithms' own init (they are registered later, so called first), so the
        # compute dtype is known.
        def tell() -> None:
            if self.verbose:
                print("slipstream: peak FLOP/s: probing the device (cached after)", file=sys.stderr)

        self.peak = peak_flops(state.device, self.configured, threads=torch.get_num_threads(), on_probe=tell)
        self.peak_name = name = peak_name(state.compute_dtype, state.device, state.unwrapped_model)
        if self.peak.source == "config" and name not in self.peak.flops:
            what = "fp32 computed on TF32 tensor cores" if name == "tf32" else "the dtype this run computes in"
            raise ConfigError(
                f"trainer.peak_tflops has no value for {name} ({what}); "
                f"give one number for every dtype or add {name}"
            )
        self.memory = PeakMemory(state.device)

    @hookimpl
    def fit_start(self, state: State) -> None:
        assert self.memory is not None
        self.memory.start()

    @hookimpl
    def fit_end(self, state: State) -> None:
        if self.memory is not None:
            self.memory.stop()

    @hookimpl
    def exception(self, state: State, error: BaseException) -> None:
        if self.memory is not None:
            self.memory.stop()

    @hookimpl
    def before_forward(self, state: State) -> None:
        # The batch is final here (resized, normalised): its size is what the model sees.
        if self.flops is None:
            return
        inputs = state.batch[0]
        shape = getattr(inputs, "shape", None)
        if shape == self._last_shape:  # most batches: the same size as the one before
            self.flops += self._last_flops
            return
        try:
            per_sample = self.per_sample[shape[1:]]
        except (KeyError, TypeError):
            per_sample = self._count(state, inputs)
            if per_sample is None:
                return
        self._last_shape, self._last_flops = shape, per_sample * shape[0]
        self.flops += self._last_flops

    def _count(self, state: State, inputs: Any) -> float | None:
        started = time.perf_counter()
        with state.untimed():
            try:
                if not isinstance(inputs, torch.Tensor):
                    raise TypeError(f"the inputs are a {type(inputs).__name__}, not a tensor")
                model = state.flops_model if state.flops_model is not None else state.unwrapped_model
                per_sample = training_flops_per_sample(model, inputs)
            except Exception as exc:  # any model may fail on meta tensors: MFU is then unknown
                self._give_up(f"{type(exc).__name__}: {exc}")
                return None
            finally:
                self.count_s += time.perf_counter() - started
        self.per_sample[inputs.shape[1:]] = per_sample
        return per_sample

    def _give_up(self, reason: str) -> None:
        self.flops = None
        self.error = " ".join(reason.split())[:300]
        warnings.warn(
            f"slipstream: cannot count this model's FLOPs, so MFU is not reported: {self.error}",
            stacklevel=2,
        )

    def mfu(self, state: State, flops: float | None, seconds: float) -> float | None:
        """``flops`` done in ``seconds`` of training as a fraction of the peak of the
        run's compute dtype; None when either is unknown."""
        if flops is None or self.peak is None or seconds <= 0:
            return None
        peak = self.peak.flops.get(self.peak_name)
        return flops / (seconds * peak) if peak else None

    def summary(self, state: State, train_s: float) -> dict[str, Any]:
        """The summary.json fields: MFU over ``train_s`` seconds of training (this
        session's), the peak used and its source, FLOPs per sample per input shape
        and the peak memory."""
        peak_mb = self.memory.peak_mb() if self.memory is not None else None
        mfu = self.mfu(state, self.flops, train_s)
        if mfu is not None and mfu > 1 and self.peak is not None and self.peak.source != "config":
            # Impossible: the cached or probed peak was measured on a busy machine.
            dtype = self.peak_name
            achieved = self.flops / train_s
            warnings.warn(
                f"slipstream: this run did {achieved / 1e9:.1f} GFLOP/s in {dtype}, more than the "
                f"peak of {self.peak.flops[dtype] / 1e9:.1f} GFLOP/s ({self.peak.source}), which "
                "was measured on a busy machine; probing again and raising the cached peak",
                stacklevel=2,
            )
            self.peak = raise_peak(state.device, self.peak, threads=torch.get_num_threads())
            mfu = self.mfu(state, self.flops, train_s)
        return {
            "mfu": mfu,
            "compute_dtype": dtype_name(state.compute_dtype),
            "peak_dtype": self.peak_name,  # the peak MFU is against: compute_dtype's, or tf32
            "peak_tflops": self.peak.tflops() if self.peak is not None else None,
            "peak_source": self.peak.source if self.peak is not None else None,
            "train_flops_per_sample": {
                "x".join(map(str, shape)): flops for shape, flops in self.per_sample.items()
            },
            "flop_count_s": round(self.count_s, 3),
            "flop_count_error": self.error,
            "peak_memory_mb": None if peak_mb is None else round(peak_mb, 1),
        }
