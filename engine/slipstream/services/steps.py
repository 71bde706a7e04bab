"""The default implementation of every step hook, registered ``trylast`` so that a
plugin's implementation replaces it and a plugin's wrapper surrounds it.

``ddp_options`` are keyword arguments of ``DistributedDataParallel`` (bucket size,
static graph, unused parameters) for the default ``wrap_model``."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from slipstream.distributed import is_distributed
from slipstream.errors import ConfigError
from slipstream.hookspecs import hookimpl
from slipstream.services.batches import check_pair
from slipstream.state import State

UNUSED_PARAMETERS = (
    "DistributedDataParallel: some of the model's parameters got no gradient in the previous "
    "step (a branch not taken, a frozen or unused layer), so their gradients were never "
    "reduced; set trainer.ddp.find_unused_parameters=true (it costs a pass over the autograd "
    "graph each step), or freeze (requires_grad=False) or remove those parameters"
)


class DefaultSteps:
    name = "engine.steps"

    def __init__(self, ddp_options: dict[str, Any] | None = None) -> None:
        self.ddp_options = dict(ddp_options or {})

    @hookimpl(trylast=True)
    def forward(self, state: State) -> Any:
        try:
            return state.model(state.batch[0])
        except RuntimeError as exc:
            if "find_unused_parameters" in str(exc):  # DDP, at the step after the one that failed
                raise ConfigError(UNUSED_PARAMETERS) from None
            raise
        except ValueError as exc:
            if "Expected more than 1 value per channel when training" in str(exc):
                raise ConfigError(
                    f"a training batch of {len(state.batch[0])} sample(s) reached a batch-norm layer, which "
                    "needs more than one value per channel: the last, partial batch of an epoch with "
                    "data.drop_last=false (or drop_last=False in a DataLoader); drop it (data.drop_last=true), "
                    "or choose a batch size that leaves no single sample over"
                ) from None
            raise

    @hookimpl(trylast=True)
    def compute_loss(self, state: State) -> Any:
        try:
            return state.loss_fn(state.outputs, state.batch[1])
        except IndexError:
            if len(state.batch) < 2:
                check_pair(state.batch, "training")
            raise
        except (TypeError, AttributeError) as exc:
            if isinstance(state.outputs, (tuple, list, dict)):
                fix = "return the logits from forward, or give a loss_fn that takes what the model returns"
                raise ConfigError(not_logits(state.outputs, f"the loss ({exc})", fix)) from None
            raise

    @hookimpl(trylast=True)
    def backward(self, state: State) -> Any:
        try:
            state.loss.backward()
        except (RuntimeError, AttributeError):
            problem = not_a_loss(state.loss)
            if problem:
                raise ConfigError(problem) from None
            raise
        return True

    @hookimpl(trylast=True)
    def should_step(self, state: State) -> Any:
        return True

    @hookimpl(trylast=True)
    def optimizer_step(self, state: State) -> Any:
        state.optimizer.step()
        return True

    # -- set-up and checkpoints: the unsharded case --------------------------------

    @hookimpl(trylast=True)
    def wrap_model(self, state: State) -> Any:
        if not is_distributed() or isinstance(state.model, DistributedDataParallel):
            return state.model
        device = state.device
        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(state.model, device_ids=ids, **self.ddp_options)

    @hookimpl(trylast=True)
    def state_dicts(self, state: State) -> Any:
        return {
            "model": state.unwrapped_model.state_dict(),
            "optimizer": state.optimizer.state_dict(),
        }

    @hookimpl(trylast=True)
    def load_state_dicts(self, state: State, state_dicts: dict[str, Any]) -> Any:
        state.unwrapped_model.load_state_dict(state_dicts["model"])
        state.optimizer.load_state_dict(state_dicts["optimizer"])
        return True


def not_a_loss(loss: Any) -> str | None:
    """What is wrong with a training loss that cannot be backpropagated (None: nothing
    this can name)."""
    if not isinstance(loss, torch.Tensor):
        return (
            f"the training loss is a {type(loss).__name__} ({loss!r}), not a tensor: loss_fn must return "
            "a tensor computed from the model's outputs (no .item() or float())"
        )
    if loss.numel() != 1:
        return (
            f"the training loss has shape {tuple(loss.shape)}, and training needs one number: a loss_fn "
            "with reduction='none' must reduce it (e.g. .mean()) before returning it"
        )
    if not loss.requires_grad:
        return (
            "the training loss does not depend on the model's parameters (it has no grad_fn): loss_fn "
            "must not detach it, and the model's parameters must require gradients"
        )
    return None


def not_logits(outputs: Any, needed_by: str, fix: str) -> str:
    """What to say when the model's outputs are not the logits a step needs."""
    if isinstance(outputs, dict):
        what = f"a dict with keys {sorted(map(str, outputs))}"
    else:
        what = f"a {type(outputs).__name__} of {len(outputs)}"
    return f"the model returned {what}, and {needed_by} needs its logits (a tensor); {fix}"
