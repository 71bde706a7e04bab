"""Top-1 (and top-5, with at least 5 classes) evaluation at an interval and at the
end of the run (none without an interval)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from slipstream.duration import Duration
from slipstream.errors import ConfigError
from slipstream.hookspecs import hookimpl
from slipstream.interval import RunInterval
from slipstream.services.batches import check_pair, to_device
from slipstream.services.steps import not_logits
from slipstream.state import State

TOP_K = 5  # accuracy_top5: whether the target is among the 5 highest logits


# How to turn evaluation off, in the config and in Python.
EVALUATION_OFF = "turn evaluation off (trainer.eval_interval: null; eval_interval=None in Python)"


class Evaluator:
    name = "engine.evaluation"

    def __init__(
        self,
        hooks: Any,
        interval: Duration | str | None = "1ep",
        prepare: Callable[[State], None] | None = None,
        guard: Callable[[State], bool] | None = None,
    ) -> None:
        """``guard``: asked before each evaluation the interval schedules; False
        (the run diverged) skips it."""
        self.hooks = hooks
        self.guard = guard or (lambda state: True)
        # The loop's explicit input step (normalisation), run after eval_batch_start.
        self.prepare = prepare or (lambda state: None)
        self.interval = RunInterval(interval)
        self._last_eval_batch: int | None = None
        self._samples = 0  # seen by the last evaluation

    @hookimpl
    def fit_start(self, state: State) -> None:
        self.interval.start(state)
        if state.eval_metrics:  # a resume whose log evaluated its checkpoint's step
            self._last_eval_batch = state.timestamp.batch

    @hookimpl
    def batch_end(self, state: State) -> None:
        # The last batch is evaluated by fit_end, once.
        if not self.interval.mid_epoch or state.is_done():
            return
        if self.interval.due_at_batch_end(state) and self.guard(state):
            self.evaluate(state)

    @hookimpl
    def epoch_end(self, state: State) -> None:
        if self.interval.due_at_epoch_end(state) and self.guard(state):
            self.evaluate(state)

    @hookimpl(tryfirst=True)
    def fit_end(self, state: State) -> None:
        # The final evaluation comes before every other fit_end, so plugins see
        # the final metrics there. No interval means no evaluation at all. An
        # interrupted run goes straight to its checkpoint (a scheduler's grace period
        # is short); diverged weights are not worth evaluating.
        if state.stop_status in ("interrupted", "diverged"):
            return
        if self.interval.enabled and self._last_eval_batch != state.timestamp.batch and self.guard(state):
            self.evaluate(state)

    @property
    def samples(self) -> int:
        """The samples the last evaluation saw (on this process)."""
        return self._samples

    def _nothing_to_evaluate(self, state: State) -> str:
        if self._samples:
            return (
                f"the evaluation data yielded no samples at step {state.timestamp.batch}, after "
                f"{self._samples} at the evaluation before: it can be read only once (an iterator or "
                "generator); pass a DataLoader (or anything iter() can start again)"
            )
        return (
            "the evaluation data yielded no samples; check it (a DataLoader with drop_last=True and "
            f"a batch larger than the dataset yields none), or {EVALUATION_OFF}"
        )

    def evaluate(self, state: State) -> dict[str, float]:
        if state.eval_loader is None:
            return {}
        started = time.perf_counter()
        model, hooks = state.model, self.hooks
        saved = state.batch, state.outputs, state.loss
        # Each module's own mode, not only the model's: a plugin may keep part of the
        # model in eval mode (frozen batch-norm statistics) for the whole run.
        modes = [(module, module.training) for module in model.modules()]
        model.eval()
        state.training = False
        try:  # the training state comes back however the evaluation ends
            hooks.eval_start(state=state)
            # loss sum, top-1 hits, samples, top-5 hits (counted only with >= 5 classes)
            totals = torch.zeros(4, dtype=torch.float64, device=state.device)
            classes = 0
            with torch.no_grad():
                for batch in state.eval_loader:
                    state.batch = to_device(batch, state.device)
                    check_pair(state.batch, "evaluation")
                    hooks.eval_batch_start(state=state)
                    self.prepare(state)
                    state.outputs = hooks.forward(state=state)
                    logits = (
                        state.outputs[0] if isinstance(state.outputs, (tuple, list)) else state.outputs
                    )
                    if not isinstance(logits, torch.Tensor):
                        fix = "return the logits from forward in eval mode (or a tuple whose first item they are)"
                        raise ConfigError(not_logits(state.outputs, "the evaluation", fix))
                    targets = state.batch[1]
                    totals[0] += eval_loss(state.loss_fn, state.outputs, logits, targets)
                    targets = class_indices(targets, logits)
                    totals[1] += (logits.argmax(dim=1) == targets).sum()
                    totals[2] += targets.numel()
                    classes = logits.shape[1]
                    if classes >= TOP_K:
                        top = logits.topk(TOP_K, dim=1).indices
                        totals[3] += (top == targets.unsqueeze(1)).any(dim=1).sum()
                    hooks.eval_batch_end(state=state)
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(totals)
            loss_sum, correct, count, correct_top5 = totals.tolist()
            if not count:  # metrics of nothing would read as a loss of 0 and an accuracy of 0
                raise ConfigError(self._nothing_to_evaluate(state))
            self._samples = int(count)
            state.eval_metrics = {"loss": loss_sum / count, "accuracy": correct / count}
            if classes >= TOP_K:
                state.eval_metrics["accuracy_top5"] = correct_top5 / count
            hooks.eval_end(state=state)
        finally:
            _restore_modes(model, modes)
            state.training = True
            state.batch, state.outputs, state.loss = saved
        self._last_eval_batch = state.timestamp.batch
        best = max(state.summary.get("best_accuracy") or 0.0, state.eval_metrics["accuracy"])
        state.summary["best_accuracy"] = best
        if "accuracy_top5" in state.eval_metrics:
            top5 = state.eval_metrics["accuracy_top5"]
            state.summary["accuracy_top5"] = top5
            state.summary["best_accuracy_top5"] = max(state.summary.get("best_accuracy_top5") or 0.0, top5)
        # Throughput in summary.json is training throughput: evaluation is set apart.
        state.summary["eval_time_s"] = (
            state.summary.get("eval_time_s", 0.0) + time.perf_counter() - started
        )
        return state.eval_metrics


def eval_loss(loss_fn: Any, outputs: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed loss of one evaluation batch. With the default ``CrossEntropyLoss``
    (any options) it is plain cross-entropy of the ``logits``, as timm and Composer report
    it: label smoothing is a training device, not what the model's predictions are worth.
    So is it for a loss that says ``evaluated_as_cross_entropy`` (``loss.name=bce``: timm
    validates a BCE-trained model with cross-entropy). A loss function of the user's own
    is evaluated as it trains, on what the model returned (its value taken as the
    batch's mean), so that ``best_metric=loss`` and ``early_stopping`` rank by it."""
    if isinstance(loss_fn, torch.nn.CrossEntropyLoss) or getattr(loss_fn, "evaluated_as_cross_entropy", False):
        return F.cross_entropy(logits.float(), targets, reduction="sum")
    value = loss_fn(outputs, targets)
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ConfigError(
            f"the evaluation computes loss_fn(logits, targets) and needs one number per batch, got "
            f"{type(value).__name__}{'' if not isinstance(value, torch.Tensor) else f' of shape {tuple(value.shape)}'}"
        )
    return value.detach().double().reshape(()) * len(logits)


def class_indices(targets: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Targets as class indices for accuracy: class probabilities (one-hot or soft
    labels, of the logits' shape) become their most likely class."""
    if targets.is_floating_point() and targets.shape == logits.shape:
        return targets.argmax(dim=1)
    if targets.is_floating_point():
        raise ConfigError(
            f"evaluation targets of shape {tuple(targets.shape)} and dtype {targets.dtype} are neither class "
            f"indices (integers) nor class probabilities of the logits' shape {tuple(logits.shape)}"
        )
    return targets


def _restore_modes(model: torch.nn.Module, modes: list[tuple[torch.nn.Module, bool]]) -> None:
    """Put back the mode each module had: ``train()`` on the model (a model may override
    it), then on each module left in another mode, parents before children."""
    model.train(modes[0][1])
    for module, training in modes:
        if module.training != training:
            module.train(training)
