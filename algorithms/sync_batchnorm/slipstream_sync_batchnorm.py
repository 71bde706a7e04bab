"""Synchronised batch norm under DDP (``torch.nn.SyncBatchNorm``; timm's ``--sync-bn``):
in training, every batch-norm layer normalises with the mean and variance of the
global batch, gathered from every process, instead of its own process's share; the
running statistics are then the same on every rank.

Model surgery at ``init``, before the engine wraps the model in DDP (``wrap_model``
runs after ``init``, as torch asks: convert, then wrap). Each ``BatchNorm1d/2d/3d``
becomes a ``SyncBatchNorm`` holding the same parameter and buffer objects (the
optimizer needs no surgery) under the same state_dict keys (a checkpoint loads into
the plain model). timm's ``BatchNormAct2d`` (batch norm, then dropout and activation)
becomes timm's ``SyncBatchNormAct``: torch's converter would make it a plain
``SyncBatchNorm`` and silently drop its activation. Any other subclass with a
``forward`` of its own is refused by name for the same reason.

Where it acts (decided at ``init``, one line each):

- one process: nothing to synchronise with; a warning, the model is left as it is
  and ``summary.json["sync_batchnorm"]`` says ``not distributed``;
- several processes on GPUs (CUDA, XPU, HPU): the conversion;
- several processes on CPUs: refused. torch's SyncBatchNorm raises at its first
  training forward for a CPU tensor ("expected input tensor to be on GPU ...",
  torch/nn/modules/batchnorm.py), and the kernels behind it (``batch_norm_stats``,
  ``batch_norm_gather_stats_with_counts``, ``batch_norm_elemt``) have no CPU
  implementation (torch 2.14). A fall-back to per-process statistics would train
  exactly the model the user asked not to train, so the run stops before it starts;
- a model without batch norm under several processes: refused by name.

MFU: torch's SyncBatchNorm raises for a ``meta`` tensor in training whenever a process
group exists, which the engine's FLOP counter runs the model on; at ``fit_start`` the
plugin hands it a copy whose SyncBatchNorm layers compute as plain batch norm.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from slipstream import Algorithm, ConfigError, State, hookimpl, meta_copy

__all__ = [
    "SYNC_DEVICE_TYPES",
    "SyncBatchNorm",
    "batchnorm_layers",
    "convert_sync_batchnorm",
    "counting_copy",
    "sync_decision",
    "synced_layers",
]

# The device types torch.nn.SyncBatchNorm synchronises (batchnorm.py's own list, less
# the out-of-tree PrivateUse1 backend).
SYNC_DEVICE_TYPES = ("cuda", "xpu", "hpu")
_PLAIN_CLASSES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _timm_norm_act() -> tuple[type | None, Any]:
    """timm's BatchNormAct2d and its converter, when timm is installed."""
    try:
        from timm.layers import BatchNormAct2d
        from timm.layers import convert_sync_batchnorm as timm_convert
    except ImportError:
        return None, None
    return BatchNormAct2d, timm_convert


def batchnorm_layers(model: nn.Module) -> list[str]:
    """Names of ``model``'s batch-norm layers that are not synchronised yet
    (``BatchNorm1d/2d/3d`` and their subclasses)."""
    return [n for n, m in model.named_modules() if isinstance(m, _PLAIN_CLASSES)]


def synced_layers(model: nn.Module) -> list[str]:
    """Names of ``model``'s ``SyncBatchNorm`` layers (timm's ``SyncBatchNormAct`` included)."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.SyncBatchNorm)]


def _unconvertible(model: nn.Module) -> list[str]:
    """Batch-norm subclasses with a forward of their own, which no converter keeps."""
    norm_act, _ = _timm_norm_act()
    known = (*_PLAIN_CLASSES, *((norm_act,) if norm_act else ()))
    lost = []
    for name, module in model.named_modules():
        if isinstance(module, _PLAIN_CLASSES):
            base = next(c for c in type(module).__mro__ if c in known)
            if type(module).forward is not base.forward:
                lost.append(f"{name or 'the model'} ({type(module).__name__})")
    return lost


def convert_sync_batchnorm(model: nn.Module, process_group: Any = None) -> tuple[nn.Module, int]:
    """``model`` with every batch-norm layer a ``SyncBatchNorm`` over ``process_group``
    (default: every process), and how many were converted. Converted in place except
    where ``model`` itself is a batch-norm layer: use the module returned. Parameters
    and buffers are the same objects under the same state_dict keys.

    Works on any device (nothing is computed); training with the result needs a GPU
    and an initialised process group. Raises :class:`slipstream.ConfigError` naming a
    batch-norm subclass whose own ``forward`` the conversion would drop."""
    lost = _unconvertible(model)
    if lost:
        raise ConfigError(
            f"sync_batchnorm cannot convert {', '.join(lost)}: a batch-norm subclass with a forward "
            "of its own would lose it as torch.nn.SyncBatchNorm"
        )
    count = len(batchnorm_layers(model))
    _, timm_convert = _timm_norm_act()
    # timm's converter is torch's plus BatchNormAct2d -> SyncBatchNormAct.
    convert = timm_convert or nn.SyncBatchNorm.convert_sync_batchnorm
    return convert(model, process_group), count


def sync_decision(world_size: int, device: torch.device) -> str:
    """What the plugin does for a run of ``world_size`` processes on ``device``:
    ``"warn"`` (one process), ``"convert"`` (several, on a device SyncBatchNorm
    synchronises, available here) or ``"refuse"`` (several, on any other device)."""
    if world_size <= 1:
        return "warn"
    if device.type == "cuda" and not torch.cuda.is_available():
        return "refuse"
    return "convert" if device.type in SYNC_DEVICE_TYPES else "refuse"


class _CountedBatchNorm(nn.SyncBatchNorm):
    """A SyncBatchNorm that computes as plain batch norm: what the FLOP counter (MFU)
    runs. torch's SyncBatchNorm raises for a ``meta`` tensor in training whenever a
    process group exists, so the engine's meta copy of the model could not be counted."""

    forward = nn.modules.batchnorm._BatchNorm.forward


def counting_copy(model: nn.Module) -> nn.Module:
    """A ``meta`` copy of ``model`` (:func:`slipstream.meta_copy`) whose SyncBatchNorm
    layers compute as plain batch norm (the same FLOPs, less the collectives)."""
    copy = meta_copy(model)
    for module in copy.modules():
        if isinstance(module, nn.SyncBatchNorm):
            module.__class__ = _CountedBatchNorm
    return copy


class SyncBatchNorm(Algorithm):
    """Batch-norm statistics over the global batch of all DDP processes (SyncBatchNorm, GPU)."""

    name = "sync_batchnorm"
    # Surgery first, so the EMA copy, channels-last, activation checkpointing's wrappers
    # and the compiled graph see the synchronised layers;
    # stochastic_depth hooks torchvision blocks' last batch norm: the layer it hooks must
    # already be the synchronised one (the conversion makes new modules, without hooks).
    runs_before = ("stochastic_depth", "ema", "channels_last", "activation_checkpointing", "torch_compile")
    conflicts_with = {
        "ghost_batchnorm": (
            "ghost batch norm normalises chunks of each process's batch by themselves, sync batch norm "
            "normalises the batches of all processes together: the two ask for opposite statistics"
        ),
        "fsdp": (
            "torch supports SyncBatchNorm under DistributedDataParallel only, and it is not verified "
            "with FSDP2's sharded parameters; use DDP (the default) with sync_batchnorm"
        ),
    }

    def __init__(self, config: None = None) -> None:
        super().__init__(config)
        self.synchronised = False

    @hookimpl
    def init(self, state: State) -> None:
        model = state.unwrapped_model
        decision = sync_decision(state.world_size, state.device)
        if decision == "warn":
            warnings.warn(
                "sync_batchnorm: this run has one process, so there is no other batch to synchronise "
                "with; batch norm is left as it is (launch several: slipstream train --nproc-per-node N)",
                stacklevel=2,
            )
            state.summary[self.name] = {"layers": 0, "synchronised": False, "reason": "not distributed: one process"}
            return
        if not batchnorm_layers(model):
            raise ConfigError(
                f"sync_batchnorm cannot change {type(model).__name__}: it has no BatchNorm1d/2d/3d layer "
                "to synchronise (a ViT normalises with LayerNorm, per sample)"
            )
        if decision == "refuse":
            raise ConfigError(
                f"algorithms.sync_batchnorm: torch {torch.__version__.split('+')[0]}'s SyncBatchNorm synchronises "
                f"only on GPUs (CUDA, XPU, HPU) and this run of {state.world_size} processes trains on "
                f"{state.device.type}; drop sync_batchnorm (each process then keeps its own statistics) "
                "or train on GPUs"
            )
        converted, count = convert_sync_batchnorm(model)
        if converted is not model:  # the model was itself one batch-norm layer
            state.model = converted
        self.synchronised = True
        state.summary[self.name] = {"layers": count, "synchronised": True, "world_size": state.world_size}

    @hookimpl
    def fit_start(self, state: State) -> None:
        # After every plugin's init and the wrap: the copy has all their surgery. A
        # plugin that set its own copy (none of those this one runs with) keeps it.
        if self.synchronised and state.flops_model is None:
            state.flops_model = counting_copy(state.unwrapped_model)

    def export_model(self, model: nn.Module) -> nn.Module:
        """Kept: a SyncBatchNorm in evaluation is plain batch norm with the same
        statistics and state_dict keys, and an export is rebuilt in one process, where
        this plugin converts nothing anyway."""
        return model
