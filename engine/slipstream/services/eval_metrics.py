"""The built-in metrics that are sums over samples: ``loss``, ``accuracy``,
``accuracy_top5`` (the defaults) and ``f1_samples``.

Each keeps one sum and a sample count. The sum stays on the device, so a batch costs
what the fixed code before metric plugins cost (no sync, no host copy); the count is a
Python int read from the batch's shape. At the end of an evaluation the engine reduces
every such metric's sums in one all-reduce (``sums`` / ``compute_from``). They import
no torchmetrics (whose import, which loads matplotlib, costs about a second), so a run
of the defaults starts as fast as before; ``tests/test_metrics.py`` checks them
against torchmetrics.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from slipstream.errors import ConfigError


class SumMetric:
    """``total / count`` over an evaluation: ``add`` a batch's sum and sample count.
    The sum stays a tensor on the device until :meth:`compute`."""

    name: ClassVar[str] = ""
    higher_is_better: ClassVar[bool] = True

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.reset()

    def to(self, device: torch.device | str) -> SumMetric:
        self.device = torch.device(device)
        if self.total is not None:
            self.total = self.total.to(self.device)
        return self

    def reset(self) -> None:
        self.total: torch.Tensor | None = None
        self.count = 0

    def add(self, value: torch.Tensor, count: int) -> None:
        value = value.detach().to(torch.float64)
        self.total = value if self.total is None else self.total + value
        self.count += count

    def sums(self) -> torch.Tensor:
        """The states to sum across ranks: the total and the count."""
        total = self.total if self.total is not None else torch.zeros((), dtype=torch.float64, device=self.device)
        count = torch.tensor(float(self.count), dtype=torch.float64, device=total.device)
        return torch.stack([total.reshape(()), count])

    @staticmethod
    def compute_from(values: list[float]) -> float:
        total, count = values
        return total / count if count else float("nan")

    def compute(self) -> float:
        return self.compute_from(self.sums().tolist())

    def update(self, outputs: Any, targets: torch.Tensor) -> None:
        raise NotImplementedError


def logits_of(outputs: Any) -> torch.Tensor:
    """The logits in what a model returned (a tensor, or a tuple whose first item they are)."""
    return outputs[0] if isinstance(outputs, (tuple, list)) else outputs


def eval_loss(
    loss_fn: Any, outputs: Any, logits: torch.Tensor, targets: torch.Tensor, task: str = "multiclass"
) -> torch.Tensor:
    """The summed loss of one evaluation batch. Of multi-hot targets (``task`` multilabel)
    it is binary cross-entropy with logits, the mean over classes summed over samples,
    whatever the built-in loss (the softmax cross-entropy would take a row for one class's
    probabilities). With the default ``CrossEntropyLoss``
    (any options) it is plain cross-entropy of the ``logits``, as timm and Composer report
    it: label smoothing is a training device, not what the model's predictions are worth.
    So is it for a loss that says ``evaluated_as_cross_entropy`` (``loss.name=bce``: timm
    validates a BCE-trained model with cross-entropy). A loss function of the user's own
    is evaluated as it trains, on what the model returned (its value taken as the
    batch's mean), so that ``best_metric=loss`` and ``early_stopping`` rank by it."""
    if (
        loss_fn is None
        or isinstance(loss_fn, torch.nn.CrossEntropyLoss)
        or getattr(loss_fn, "evaluated_as_cross_entropy", False)
    ):
        if task == "multilabel":
            bce = F.binary_cross_entropy_with_logits(logits.float(), targets.float(), reduction="none")
            return bce.mean(dim=1).sum()
        return F.cross_entropy(logits.float(), targets, reduction="sum")
    value = loss_fn(outputs, targets)
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ConfigError(
            f"the evaluation computes loss_fn(logits, targets) and needs one number per batch, got "
            f"{type(value).__name__}{'' if not isinstance(value, torch.Tensor) else f' of shape {tuple(value.shape)}'}"
        )
    return value.detach().double().reshape(()) * len(logits)


class Loss(SumMetric):
    """Mean loss per sample: the run's loss function (cross-entropy by default)."""

    name = "loss"
    higher_is_better = False
    raw = True  # what the model returned, and the targets as they came (class probabilities too)

    def __init__(self, loss_fn: Any = None, task: str = "multiclass") -> None:
        super().__init__()
        self.loss_fn, self.task = loss_fn, task

    def update(self, outputs: Any, targets: torch.Tensor) -> None:
        logits = logits_of(outputs)
        self.add(eval_loss(self.loss_fn, outputs, logits, targets, self.task), len(logits))


class Accuracy(SumMetric):
    """Top-1 accuracy: the share of samples whose highest logit is the target class."""

    name = "accuracy"
    tasks = ("multiclass",)

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.add((outputs.argmax(dim=1) == targets).sum(), len(outputs))


class AccuracyTop5(SumMetric):
    """Top-5 accuracy: the share of samples whose target is among the 5 highest logits."""

    name = "accuracy_top5"
    tasks = ("multiclass",)
    min_classes = 5
    k = 5

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        top = outputs.topk(self.k, dim=1).indices
        self.add((top == targets.unsqueeze(1)).any(dim=1).sum(), len(outputs))


class F1Samples(SumMetric):
    """Multi-label F1 per sample, averaged over samples (scikit-learn's average='samples')."""

    name = "f1_samples"
    tasks = ("multilabel",)

    def __init__(self, threshold: float = 0.5) -> None:
        super().__init__()
        if not 0 < threshold < 1:
            raise ValueError(f"threshold is a probability in (0, 1), got {threshold!r}")
        self.threshold = threshold

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        predicted = outputs.sigmoid() > self.threshold
        actual = targets > 0.5
        hits = (predicted & actual).sum(dim=1)
        both = predicted.sum(dim=1) + actual.sum(dim=1)
        # A sample with no label and none predicted scores 0, as scikit-learn's default does.
        f1 = torch.where(both > 0, 2 * hits / both.clamp(min=1), torch.zeros_like(hits, dtype=torch.float))
        self.add(f1.sum(), len(outputs))
