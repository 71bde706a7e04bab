"""Matmul precision: let fp32 matmuls and convolutions use faster internal formats.

``torch.set_float32_matmul_precision("high")`` lets fp32 matmuls run in TF32 on
Ampere and newer GPUs (a 10-bit mantissa on tensor cores, several times the fp32
throughput); ``"medium"`` also allows bf16 internally, which on CPU makes oneDNN run
fp32 ``Linear`` layers in bf16 where the CPU has it. cuDNN convolutions get TF32
through their own switch, and ``cudnn.benchmark`` times the convolution algorithms
once per input shape and keeps the fastest. These are process-wide settings, so the
plugin records what they were and puts them back when the run ends, even when it
fails.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from slipstream import Algorithm, State, check_plugin_options, check_value, hookimpl, plugin_option

PRECISIONS = ("highest", "high", "medium")


@dataclass
class MatmulPrecisionConfig:
    # torch.set_float32_matmul_precision: "high" = TF32 matmuls on CUDA (this is
    # also torch.backends.cuda.matmul.allow_tf32), "medium" = bf16 allowed too.
    precision: str = plugin_option("high", choices=PRECISIONS)
    cudnn_tf32: bool = True  # torch.backends.cudnn.allow_tf32 (convolutions, CUDA)
    cudnn_benchmark: bool = True  # torch.backends.cudnn.benchmark (CUDA)

    def __post_init__(self) -> None:
        check_plugin_options(self)


@dataclass
class MatmulSettings:
    """The process-wide switches this plugin changes."""

    precision: str
    cudnn_tf32: bool
    cudnn_benchmark: bool

    @classmethod
    def current(cls) -> MatmulSettings:
        return cls(
            precision=torch.get_float32_matmul_precision(),
            cudnn_tf32=torch.backends.cudnn.allow_tf32,
            cudnn_benchmark=torch.backends.cudnn.benchmark,
        )


def set_matmul_precision(
    precision: str = "high", cudnn_tf32: bool = True, cudnn_benchmark: bool = True
) -> MatmulSettings:
    """Apply the settings process-wide and return the previous ones, so that
    ``set_matmul_precision(**asdict(previous))`` puts them back.

    >>> previous = set_matmul_precision("medium")
    >>> torch.get_float32_matmul_precision()
    'medium'
    >>> _ = set_matmul_precision(**asdict(previous))
    """
    check_value("precision", precision, choices=PRECISIONS)
    previous = MatmulSettings.current()
    torch.set_float32_matmul_precision(precision)
    torch.backends.cudnn.allow_tf32 = cudnn_tf32
    torch.backends.cudnn.benchmark = cudnn_benchmark
    return previous


class MatmulPrecision(Algorithm):
    """Set float32 matmul precision (TF32), cuDNN TF32 and benchmark mode for the run."""

    name = "matmul_precision"
    config_class = MatmulPrecisionConfig

    def __init__(self, config: MatmulPrecisionConfig | None = None) -> None:
        super().__init__(config)
        self.previous: MatmulSettings | None = None

    @hookimpl
    def init(self, state: State) -> None:
        # At init rather than fit_start, so that plugins that run code at init
        # (torch_compile tracing, model surgery) already see the run's settings.
        if self.previous is None:
            self.previous = set_matmul_precision(**asdict(self.config))
        state.summary["matmul_precision"] = self.config.precision

    @hookimpl(trylast=True)
    def fit_end(self, state: State) -> None:
        # trylast: every other fit_end (the final evaluation, the last checkpoint)
        # still runs with the run's settings.
        self.restore()

    @hookimpl(trylast=True)
    def exception(self, state: State) -> None:
        self.restore()

    def restore(self) -> None:
        """Put back the settings that were in force before the run (idempotent)."""
        if self.previous is not None:
            set_matmul_precision(**asdict(self.previous))
            self.previous = None
