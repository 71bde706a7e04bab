"""The built-in metrics on torchmetrics: each a torchmetrics class with its options set,
so its states, their reduction across ranks (at ``compute``) and its edge cases are
torchmetrics'. Imported only by a run that names one of them (torchmetrics' import
costs about a second)."""

from __future__ import annotations

from typing import Any

from torchmetrics.classification import (
    MulticlassAccuracy,
    MulticlassCalibrationError,
    MulticlassConfusionMatrix,
    MulticlassF1Score,
    MulticlassPrecision,
    MulticlassRecall,
    MultilabelAveragePrecision,
)

SINGLE_LABEL = ("multiclass",)


class BalancedAccuracy(MulticlassAccuracy):
    """Balanced accuracy: the mean over classes of each class's recall."""

    name = "balanced_accuracy"
    tasks = SINGLE_LABEL

    def __init__(self, num_classes: int, **kwargs: Any) -> None:
        super().__init__(num_classes, average="macro", **kwargs)


class F1Macro(MulticlassF1Score):
    """F1 score of each class, averaged over classes."""

    name = "f1_macro"
    tasks = SINGLE_LABEL

    def __init__(self, num_classes: int, **kwargs: Any) -> None:
        super().__init__(num_classes, average="macro", **kwargs)


class PrecisionMacro(MulticlassPrecision):
    """Precision of each class, averaged over classes."""

    name = "precision_macro"
    tasks = SINGLE_LABEL

    def __init__(self, num_classes: int, **kwargs: Any) -> None:
        super().__init__(num_classes, average="macro", **kwargs)


class RecallMacro(MulticlassRecall):
    """Recall of each class, averaged over classes (equal to balanced_accuracy)."""

    name = "recall_macro"
    tasks = SINGLE_LABEL

    def __init__(self, num_classes: int, **kwargs: Any) -> None:
        super().__init__(num_classes, average="macro", **kwargs)


class CalibrationError(MulticlassCalibrationError):
    """Expected calibration error (ECE): confidence against accuracy in 15 bins, L1."""

    name = "calibration_error"
    tasks = SINGLE_LABEL

    def __init__(self, num_classes: int, n_bins: int = 15, **kwargs: Any) -> None:
        super().__init__(num_classes, n_bins=n_bins, norm="l1", **kwargs)


class ConfusionMatrix(MulticlassConfusionMatrix):
    """Confusion matrix (rows: target class, columns: predicted), written to a file per evaluation."""

    name = "confusion_matrix"
    tasks = SINGLE_LABEL
    to_file = True

    def __init__(self, num_classes: int, **kwargs: Any) -> None:
        super().__init__(num_classes, **kwargs)


class MeanAveragePrecision(MultilabelAveragePrecision):
    """Multi-label mean average precision (mAP): average precision per label, averaged."""

    name = "map"
    tasks = ("multilabel",)

    def __init__(self, num_classes: int, **kwargs: Any) -> None:
        super().__init__(num_labels=num_classes, average="macro", **kwargs)
