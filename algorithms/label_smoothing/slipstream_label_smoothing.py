"""Label smoothing on the training loss: cross-entropy, or bce (one sigmoid per class).

Training against ``(1 - s) * one_hot + s / K`` instead of hard labels keeps the
logits from growing without bound, which regularises the model and usually buys
accuracy for free: fewer epochs reach the same accuracy. It costs next to nothing
per step (torch's ``cross_entropy(label_smoothing=s)``: ~80 us more on a CPU).

How it composes: the plugin wraps the ``compute_loss`` step and, for the duration
of that step only, swaps ``state.loss_fn`` for the same cross-entropy with
``label_smoothing=s`` (for ``loss.name=bce``, the same BCE with ``smoothing=s``:
targets ``(1 - s) * p + s / K``, as timm smooths them for its BinaryCrossEntropy;
any loss with a ``with_label_smoothing(s)`` method is smoothed by that). So whatever
computes the loss inside (the engine's default,
or a plugin that replaces ``compute_loss`` and calls ``state.loss_fn``) smooths,
wrappers outside it (autocast, division by the accumulation count) see the
smoothed loss, and nothing else does: evaluation computes its own plain
cross-entropy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream import Algorithm, ConfigError, State, check_plugin_options, check_value, hookimpl, plugin_option

SMOOTHING = {"low": 0, "high": 1, "high_open": True, "note": "0 = off"}


@dataclass
class LabelSmoothingConfig:
    # probability mass spread uniformly over all classes
    smoothing: float = plugin_option(0.1, **SMOOTHING)

    def __post_init__(self) -> None:
        check_plugin_options(self)


def smooth_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, smoothing: float, reduction: str = "mean"
) -> torch.Tensor:
    """Cross-entropy against labels smoothed by ``smoothing``: the target is
    ``(1 - smoothing) * one_hot(targets) + smoothing / num_classes``.

    ``targets`` are class indices (or class probabilities, smoothed the same way).
    Equal to ``nn.CrossEntropyLoss(label_smoothing=smoothing)``: it is torch's implementation.
    """
    check_value("smoothing", smoothing, **SMOOTHING)
    return F.cross_entropy(logits, targets, reduction=reduction, label_smoothing=smoothing)


def smoothed_loss(
    loss_fn: Callable[..., torch.Tensor], smoothing: float
) -> Callable[..., torch.Tensor]:
    """The cross-entropy ``loss_fn`` with ``label_smoothing=smoothing``, keeping its
    class weights, ignore_index and reduction; a loss that says how to smooth itself
    (a ``with_label_smoothing(smoothing)`` method and a ``smoothing`` attribute, as
    ``loss.name=bce`` has) smoothed that way. Any other loss is an error: there is no
    generic way to smooth it."""
    smooth = getattr(loss_fn, "with_label_smoothing", None)
    if callable(smooth):
        if getattr(loss_fn, "smoothing", 0):
            raise ConfigError(
                f"algorithms.label_smoothing: the run's loss already smooths labels "
                f"(smoothing={loss_fn.smoothing}); drop one of the two"
            )
        return smooth(smoothing)
    if isinstance(loss_fn, nn.CrossEntropyLoss):
        if loss_fn.label_smoothing:
            raise ConfigError(
                f"algorithms.label_smoothing: the run's loss already smooths labels "
                f"(label_smoothing={loss_fn.label_smoothing}); drop one of the two"
            )
        return nn.CrossEntropyLoss(
            weight=loss_fn.weight,
            ignore_index=loss_fn.ignore_index,
            reduction=loss_fn.reduction,
            label_smoothing=smoothing,
        )
    if loss_fn is F.cross_entropy:
        return functools.partial(F.cross_entropy, label_smoothing=smoothing)
    raise ConfigError(
        "algorithms.label_smoothing: needs the run's loss_fn to be nn.CrossEntropyLoss "
        f"(or F.cross_entropy) or loss.name=bce, got {type(loss_fn).__name__}"
    )


class LabelSmoothing(Algorithm):
    """Label smoothing on the training cross-entropy or BCE (evaluation loss stays plain)."""

    name = "label_smoothing"
    config_class = LabelSmoothingConfig

    def __init__(self, config: LabelSmoothingConfig | None = None) -> None:
        super().__init__(config)
        self._source: Any = None  # the loss_fn the smoothed one was derived from
        self._smoothed: Callable[..., torch.Tensor] | None = None

    def _smoothed_for(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        # Derived once, again only if something replaces state.loss_fn mid-run.
        if loss_fn is not self._source or self._smoothed is None:
            self._smoothed = smoothed_loss(loss_fn, self.config.smoothing)
            self._source = loss_fn
        return self._smoothed

    @hookimpl
    def fit_start(self, state: State) -> None:
        self._smoothed_for(state.loss_fn)  # an unsupported loss fails before the first batch

    @hookimpl(wrapper=True)
    def compute_loss(self, state: State) -> Any:
        plain = state.loss_fn
        state.loss_fn = self._smoothed_for(plain)
        try:
            return (yield)
        finally:
            state.loss_fn = plain
