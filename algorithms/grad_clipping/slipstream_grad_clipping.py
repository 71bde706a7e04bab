"""Gradient clipping: bound the gradient before each optimizer step.

Clipping is not a speed-up by itself: it keeps large learning rates, short warm-ups
and low-precision training stable, which is what lets the other techniques go fast.
It clips by total norm (``torch.nn.utils.clip_grad_norm_``) or by value
(``torch.nn.utils.clip_grad_value_``) and logs the pre-clip gradient norm as a device
tensor, read only at the logging interval.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

import torch

from slipstream import Algorithm, State, check_plugin_options, hookimpl, plugin_option


@dataclass
class GradClippingConfig:
    # clip the total gradient norm to this
    max_norm: Optional[float] = plugin_option(None, low=0, low_open=True)
    # or clamp every gradient element to [-v, v]
    clip_value: Optional[float] = plugin_option(None, low=0, low_open=True)
    # the p of the p-norm (inf for the max-norm)
    norm_type: float = plugin_option(2.0, low=0, low_open=True, finite=False, note="2.0 for L2, inf for max")
    log_grad_norm: bool = True  # put the pre-clip norm in metrics.jsonl as grad_norm

    def __post_init__(self) -> None:
        check_plugin_options(self)
        if (self.max_norm is None) == (self.clip_value is None):
            raise ValueError(
                "set exactly one of max_norm (clip by total norm) or clip_value (clip by value), "
                f"got max_norm={self.max_norm}, clip_value={self.clip_value}"
            )


def clip_gradients(
    parameters: Iterable[torch.Tensor],
    max_norm: float | None = None,
    clip_value: float | None = None,
    norm_type: float = 2.0,
    return_norm: bool = True,
) -> torch.Tensor | None:
    """Clip the gradients of ``parameters`` in place; return their pre-clip total norm.

    Exactly one of ``max_norm`` (scale all gradients so that their total
    ``norm_type``-norm is at most ``max_norm``) or ``clip_value`` (clamp each element
    to ``[-clip_value, clip_value]``) must be given. The norm is a device tensor (no
    sync); it is ``None`` when clipping by value with ``return_norm=False``, which
    saves one pass over the gradients. Non-finite gradients do not raise: the norm is
    inf/NaN, and a GradScaler skips that step anyway.

    >>> p = torch.nn.Parameter(torch.zeros(4)); p.grad = torch.full((4,), 3.0)
    >>> clip_gradients([p], max_norm=1.0)
    tensor(6.)
    >>> round(p.grad.norm().item(), 4)
    1.0
    """
    if (max_norm is None) == (clip_value is None):
        raise ValueError("give exactly one of max_norm or clip_value")
    params = [p for p in parameters if p.grad is not None]
    if max_norm is not None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    norm = None
    if return_norm:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=norm_type)
    torch.nn.utils.clip_grad_value_(params, clip_value)
    return norm


class GradClipping(Algorithm):
    """Clip gradients by total norm or by value before each optimizer step."""

    name = "grad_clipping"
    config_class = GradClippingConfig
    # True gradients: after mixed_precision's GradScaler has unscaled them.
    runs_after = ("mixed_precision",)

    @hookimpl
    def before_optimizer_step(self, state: State) -> None:
        cfg = self.config
        # The optimizer's parameters are the ones about to be stepped (plugins may
        # have added groups at init).
        params = (p for group in state.optimizer.param_groups for p in group["params"])
        norm = clip_gradients(
            params,
            max_norm=cfg.max_norm,
            clip_value=cfg.clip_value,
            norm_type=cfg.norm_type,
            return_norm=cfg.log_grad_norm,
        )
        if norm is not None and cfg.log_grad_norm:
            state.metrics["grad_norm"] = norm.detach()
