"""The engine's own plugins: default steps and the services that are not speed-up
techniques (normalisation, evaluation, metrics, MFU and memory, time to target,
progress, checkpoints, summary).
They sit on the same hook bus as every algorithm."""

from slipstream.services.checkpointer import Checkpointer
from slipstream.services.evaluation import Evaluator
from slipstream.services.metrics import MetricsLogger
from slipstream.services.normalize import Normalize
from slipstream.services.progress import ProgressBar
from slipstream.services.steps import DefaultSteps
from slipstream.services.summary import RunSummary
from slipstream.services.target import TargetAccuracy
from slipstream.services.utilization import Utilization

__all__ = [
    "Checkpointer",
    "DefaultSteps",
    "Evaluator",
    "MetricsLogger",
    "Normalize",
    "ProgressBar",
    "RunSummary",
    "TargetAccuracy",
    "Utilization",
]
