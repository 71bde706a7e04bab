"""The engine's own plugins: default steps and the services that are not speed-up
techniques (normalisation, evaluation, metrics, MFU and memory, time to target,
progress, checkpoints, summary).
They sit on the same hook bus as every algorithm."""

from .checkpoint import Checkpointer
from .evaluation import Evaluator
from .metrics import MetricsLogger
from .normalize import Normalize
from .progress import ProgressBar
from .steps import DefaultSteps
from .summary import SummaryWriter
from .target import TargetAccuracy
from .utilization import Utilization

__all__ = [
    "Checkpointer",
    "DefaultSteps",
    "Evaluator",
    "MetricsLogger",
    "Normalize",
    "ProgressBar",
    "SummaryWriter",
    "TargetAccuracy",
    "Utilization",
]
