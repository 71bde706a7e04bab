"""The engine's own plugins: default steps and the services that are not speed-up
techniques (normalisation, evaluation, metrics, progress, checkpoints, summary).
They sit on the same hook bus as every algorithm."""

from .checkpoint import Checkpointer
from .evaluation import Evaluator
from .metrics import MetricsLogger
from .normalize import Normalize
from .progress import ProgressBar
from .steps import DefaultSteps
from .summary import SummaryWriter

__all__ = [
    "Checkpointer",
    "DefaultSteps",
    "Evaluator",
    "MetricsLogger",
    "Normalize",
    "ProgressBar",
    "SummaryWriter",
]
