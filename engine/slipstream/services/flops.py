"""Training FLOPs per sample, counted without touching the model.

``torch.utils.flop_counter.FlopCounterMode`` counts the matmuls, convolutions and
attention of one forward and backward pass. The pass runs on a copy of the model
whose parameters and buffers live on the ``meta`` device, with meta inputs of the
batch's shape: nothing is computed or allocated, and the real model's weights,
gradients, batch-norm statistics and the random number generators stay exactly as
they were.

>>> import torch
>>> model = torch.nn.Linear(10, 5)
>>> # forward 2*10*5; backward the weight gradient only (inputs need none)
>>> training_flops_per_sample(model, torch.empty(8, 10))
200.0
"""

from __future__ import annotations

import copy
import functools
import types
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["meta_copy", "training_flops_per_sample"]


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the ``meta`` device.

    The tensors are put into deepcopy's memo first, so no real storage is copied
    (a copy of a large model costs no memory), and shared weights stay shared.

    Module hooks that are objects (a weight-norm or a token-grid hook) are part of
    the model and are copied with it. Hooks that are functions or bound methods are
    left off the copy: they reach state outside the model (a monitor's records, a
    plugin), which a counting pass must not touch or copy.
    """
    memo: dict[int, Any] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        if isinstance(tensor, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = meta
    outside: set[int] = set()  # hook handle ids, unique across modules
    for module in model.modules():
        for attr in _HOOKS:
            for handle_id, hook in getattr(module, attr, {}).items():
                if isinstance(hook, (types.FunctionType, types.MethodType, functools.partial)):
                    memo[id(hook)] = hook  # not deep-copied: no copy of its owner
                    outside.add(handle_id)
    copied = copy.deepcopy(model, memo)
    if outside:
        for module in copied.modules():
            for attr in (*_HOOKS, *_HOOK_FLAGS):
                hooks = getattr(module, attr, None)
                for handle_id in outside & set(hooks or ()):
                    del hooks[handle_id]
    return copied


_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
# Per-hook options, keyed by the same handle ids.
_HOOK_FLAGS = (
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def training_flops_per_sample(model: nn.Module, inputs: torch.Tensor) -> float:
    """FLOPs of one forward and backward pass of ``model`` per sample, for inputs
    of the shape and dtype of ``inputs`` (the first dimension is the batch).

    The model is counted in its current mode (train or eval). The backward pass
    starts from the sum of the outputs: the loss adds no matmul worth counting, and
    the FLOPs of backward do not depend on the gradient's values. Recomputation
    (activation checkpointing) is counted where the model does it.
    """
    if inputs.dim() == 0 or len(inputs) == 0:
        raise ValueError(
            f"inputs must have a non-empty batch dimension, got shape {tuple(inputs.shape)}"
        )
    copy_ = meta_copy(model)
    meta_inputs = torch.empty(inputs.shape, dtype=inputs.dtype, device="meta")
    # Meta tensors draw no random numbers today; forking makes that a guarantee.
    with torch.random.fork_rng(devices=[]), FlopCounterMode(display=False) as counter:
        outputs = copy_(meta_inputs)
        leaves = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        if leaves:
            torch.autograd.backward([t.float().sum() for t in leaves])
    return counter.get_total_flops() / len(inputs)
