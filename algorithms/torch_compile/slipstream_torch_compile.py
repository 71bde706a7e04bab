"""torch.compile for the model: TorchDynamo captures the forward (and, through
AOTAutograd, the backward) as graphs, and Inductor fuses their element-wise work into
generated C++/OpenMP (CPU) or Triton (CUDA) kernels, saving memory traffic and
Python overhead per step.

Compilation happens on the first call and again for each input the compiled graph's
guards reject (a new image size, eval mode, a smaller last batch), so the plugin
times those steps and reports compile time apart from training time in
``summary.json``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from slipstream import Algorithm, ConfigError, State, check_plugin_options, hookimpl, plugin_option

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class TorchCompileConfig:
    # None = "default"; modes apply to the inductor backend
    mode: Optional[str] = plugin_option(None, choices=MODES, note="or null")
    backend: str = "inductor"  # any name in torch.compiler.list_backends(exclude_tags=())
    fullgraph: bool = False  # True: a graph break is an error instead of a slow fallback
    dynamic: Optional[bool] = None  # None: torch's automatic dynamic shapes
    # Compile the height and width of training inputs as dynamic from the first step.
    # None: only when a plugin varies the input size (state.varying_input_size, which
    # image_size_curriculum sets).
    dynamic_image_size: Optional[bool] = None

    def __post_init__(self) -> None:
        check_plugin_options(self)
        if not self.backend:
            raise ValueError("backend must be a backend name such as 'inductor', got ''")
        if self.mode not in (None, "default") and self.backend != "inductor":
            raise ValueError(
                f"mode {self.mode!r} applies to the inductor backend only, "
                f"got backend {self.backend!r}"
            )


def check_backend(backend: str) -> None:
    """Raise :class:`slipstream.ConfigError` unless ``backend`` is a registered
    torch.compile backend (debug ones such as ``eager`` and ``aot_eager`` included)."""
    available = torch.compiler.list_backends(exclude_tags=())
    if backend not in available:
        raise ConfigError(
            f"algorithms.torch_compile.backend: unknown backend {backend!r}; "
            f"available: {', '.join(available)}"
        )


def compile_model(
    model: nn.Module,
    mode: str | None = None,
    backend: str = "inductor",
    fullgraph: bool = False,
    dynamic: bool | None = None,
) -> nn.Module:
    """``torch.compile(model, ...)`` after checking ``backend`` and ``mode``.

    Returns the ``OptimizedModule``; it shares ``model``'s parameters (an optimizer
    built on ``model`` is still right) and ``model`` is its ``_orig_mod``, which
    :func:`slipstream.unwrap_model` returns for checkpoints.
    """
    if mode is not None and mode not in MODES:
        raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    check_backend(backend)
    mode = None if mode == "default" else mode  # other backends reject mode="default"
    return torch.compile(model, mode=mode, backend=backend, fullgraph=fullgraph, dynamic=dynamic)


def mark_image_size_dynamic(inputs: Any) -> Any:
    """Ask torch.compile to compile the height and width of a 4-D batch as symbols.

    ``maybe_mark_dynamic`` (not ``mark_dynamic``): a model that needs a fixed size is
    specialised instead of failing. Returns ``inputs``, marked in place.
    """
    if isinstance(inputs, torch.Tensor) and inputs.dim() == 4:
        torch._dynamo.maybe_mark_dynamic(inputs, 2)
        torch._dynamo.maybe_mark_dynamic(inputs, 3)
    return inputs


# Dynamo's own global counters (process-wide, so the plugin keeps differences):
# frames/ok counts successful compilations, first ones and recompiles alike.
def _compiles() -> int:
    return torch._dynamo.utils.counters["frames"]["ok"]


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


# A run whose compilation took at least this share of its time (and this many seconds)
# is told that compiling probably cost more than it saved.
SHORT_RUN_SHARE = 0.5
SHORT_RUN_MIN_S = 1.0


class _StepClock:
    """Host wall time of steps, split into steps that compiled and the others."""

    def __init__(self) -> None:
        self.compiled: list[float] = []
        self.plain: deque[float] = deque(maxlen=200)
        self._start = 0.0
        self._frames = 0

    def start(self) -> None:
        self._frames = _compiles()
        self._start = time.perf_counter()

    def stop(self) -> bool:
        """Record the step; return whether it compiled."""
        elapsed = time.perf_counter() - self._start
        compiled = _compiles() != self._frames
        (self.compiled if compiled else self.plain).append(elapsed)
        return compiled

    def typical(self) -> float:
        return statistics.median(self.plain) if self.plain else 0.0

    def compile_time(self) -> float:
        """Time of compiling steps beyond a typical step (all of it when every step compiled)."""
        typical = self.typical()
        return sum(max(0.0, t - typical) for t in self.compiled)


class TorchCompile(Algorithm):
    """Compile the model with torch.compile (Inductor by default); reports compile time."""

    name = "torch_compile"
    config_class = TorchCompileConfig
    # Compile the model as the other plugins leave it (converted, checkpointed,
    # copied for EMA), under the autocast mixed_precision puts around forward.
    runs_after = (
        "channels_last",
        "locality_ffn",
        "activation_checkpointing",
        "ema",
        "mixed_precision",
        "image_size_curriculum",
    )

    def __init__(self, config: TorchCompileConfig | None = None) -> None:
        super().__init__(config)
        self.mark_sizes = False
        self.train_clock = _StepClock()
        self.eval_clock = _StepClock()
        self._first_step_s: float | None = None
        self._frames0 = self._breaks0 = 0
        self.stats: dict[str, Any] = {}  # what went to summary.json["compile"], for scripts

    @hookimpl
    def init(self, state: State) -> None:
        cfg = self.config
        check_backend(cfg.backend)
        if hasattr(state.model, "_orig_mod"):
            warnings.warn("torch_compile: the model is already compiled; left as is", stacklevel=1)
            return
        if cfg.backend == "inductor" and state.device.type == "cpu" and not _has_cxx():
            warnings.warn(
                "torch_compile: Inductor on CPU needs a C++ compiler (g++ or clang++) on PATH "
                "and none was found; the first step will fail. Install one or set "
                "algorithms.torch_compile.backend=aot_eager",
                stacklevel=1,
            )
        self._frames0, self._breaks0 = _compiles(), _graph_breaks()
        state.model = compile_model(state.model, cfg.mode, cfg.backend, cfg.fullgraph, cfg.dynamic)

    @hookimpl
    def fit_start(self, state: State) -> None:
        # Decided here, after every plugin's init: a plugin that varies the input size
        # says so at init (state.varying_input_size), in whatever order it runs. The
        # model compiles at its first forward, so nothing is lost by waiting.
        cfg = self.config
        varying = state.varying_input_size
        wanted = varying if cfg.dynamic_image_size is None else cfg.dynamic_image_size
        # dynamic=False means "always specialise": marking would contradict it.
        self.mark_sizes = wanted and cfg.dynamic is not False
        if varying and cfg.dynamic is False:
            limit = getattr(torch._dynamo.config, "recompile_limit", None)
            warnings.warn(
                "torch_compile: dynamic=false while a plugin varies the image size: every new "
                f"size compiles again, and after {limit} sizes torch gives up and runs the model "
                "uncompiled",
                stacklevel=1,
            )

    @hookimpl(tryfirst=True)
    def batch_start(self, state: State) -> None:
        self.train_clock.start()

    @hookimpl
    def before_forward(self, state: State) -> None:
        # Here, not at batch_start: every batch transform has run, and each one
        # makes a new tensor that would not carry the mark.
        if self.mark_sizes:
            mark_image_size_dynamic(state.batch[0])

    @hookimpl
    def batch_end(self, state: State) -> None:
        compiled = self.train_clock.stop()
        if self._first_step_s is None:
            self._first_step_s = self.train_clock.compiled[-1] if compiled else 0.0
        elif compiled and len(self.train_clock.compiled) == 2:
            shape = tuple(state.batch[0].shape)
            warnings.warn(
                f"torch_compile: the model compiled again in batch {state.timestamp.batch} of the run "
                f"(inputs {shape}); every recompile costs about as much as the first compile. "
                "A new image size: give image_size_curriculum.size_multiple a multiple of the "
                "network's stride (32 for a ResNet) so that one dynamic graph fits every size. "
                "A smaller last batch: drop_last=True. TORCH_LOGS=recompiles gives the reason",
                stacklevel=1,
            )

    @hookimpl(tryfirst=True)
    def eval_batch_start(self, state: State) -> None:
        self.eval_clock.start()

    @hookimpl
    def eval_batch_end(self, state: State) -> None:
        self.eval_clock.stop()

    @hookimpl
    def fit_end(self, state: State) -> None:
        self._report(state)
        self._warn_if_it_did_not_pay(state)

    @hookimpl
    def exception(self, state: State, error: BaseException) -> None:
        self._report(state)

    def _report(self, state: State) -> None:
        train_s, eval_s = self.train_clock.compile_time(), self.eval_clock.compile_time()
        typical = self.train_clock.typical()
        self.stats = {
            "train_s": round(train_s, 3),
            "eval_s": round(eval_s, 3),
            "first_step_s": round(max(0.0, (self._first_step_s or 0.0) - typical), 3),
            "typical_step_s": round(typical, 5),
            "compiles": _compiles() - self._frames0,
            "compiling_steps": len(self.train_clock.compiled),
            "graph_breaks": _graph_breaks() - self._breaks0,
            "dynamic_image_size": self.mark_sizes,
            "backend": self.config.backend,
            "mode": self.config.mode or "default",
        }
        # Training throughput in summary.json includes the compiling steps; this is
        # the part of the wall time they cost beyond ordinary steps.
        state.summary["compile_time_s"] = round(train_s + eval_s, 3)
        session_s = state.session_elapsed_s
        self.stats["share_of_run"] = round((train_s + eval_s) / session_s, 3) if session_s > 0 else None
        state.summary["compile"] = self.stats

    def _warn_if_it_did_not_pay(self, state: State) -> None:
        # A compiled step is faster, but the compilation sits inside the run's time: on
        # an H100 26 s of it in a 32 s run made resnet18_fast reach the baseline's
        # accuracy 0.62x as fast as the baseline, against 5.4x without torch_compile.
        share = self.stats.get("share_of_run")
        compile_s = state.summary["compile_time_s"]
        if share is not None and share >= SHORT_RUN_SHARE and compile_s >= SHORT_RUN_MIN_S:
            warnings.warn(
                f"torch_compile: compiling took {compile_s:.1f} s, {100 * share:.0f} % of this run's "
                f"{state.session_elapsed_s:.1f} s; a run this short rarely wins that back. Leave "
                "torch_compile out of short runs, or compare both with `slipstream compare`",
                stacklevel=1,
            )


def _has_cxx() -> bool:
    candidates = (os.environ.get("CXX"), "g++", "clang++", "c++")
    return any(c and shutil.which(c) for c in candidates)
