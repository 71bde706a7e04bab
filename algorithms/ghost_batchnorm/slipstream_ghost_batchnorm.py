"""Ghost batch normalisation (Hoffer et al. 2017, "Train longer, generalize better";
Composer's GhostBatchNorm): in training, every batch-norm layer normalises each chunk
of about ``ghost_batch_size`` samples of the batch with that chunk's own statistics,
as if the batch were several small ones; in evaluation it is plain batch norm with the
running statistics. A regulariser for large per-process batches.

Model surgery at ``init``: every ``nn.BatchNorm1d`` / ``2d`` / ``3d`` (and subclasses
that keep batch norm's attributes, such as timm's ``BatchNormAct2d``) changes class in
place to a ghost class made from its own, whose ``forward`` splits the batch and calls
the original ``forward`` on each chunk. Parameters, buffers, hooks and state_dict keys
stay the same objects and names, so the optimizer needs no surgery and a checkpoint of
a ghost run loads into the plain model (and the other way round).

Chunks: a batch of ``B`` samples is cut into ``ceil(B / ghost_batch_size)`` chunks of
near-equal size (``tensor_split``: sizes differ by at most one, none above
``ghost_batch_size``), as Composer does. A batch no larger than ``ghost_batch_size`` is
one chunk, exactly plain batch norm (Composer raises there instead; a last, smaller
batch of an epoch should not end a run).

Running statistics: each chunk updates them in turn, with the momentum divided by the
number of chunks, so that one training step moves them about as far as plain batch
norm's one update does (Composer's rule). ``num_batches_tracked`` counts chunks; with
``momentum=None`` (a cumulative average) that makes the average over chunks exact.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from slipstream import Algorithm, ConfigError, State, check_plugin_options, check_value, hookimpl, plugin_option

__all__ = [
    "GhostBatchNorm",
    "GhostBatchNorm1d",
    "GhostBatchNorm2d",
    "GhostBatchNorm3d",
    "GhostBatchNormConfig",
    "apply_ghost_batchnorm",
    "ghost_chunks",
    "ghost_layers",
    "remove_ghost_batchnorm",
]

_PLAIN_CLASSES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def ghost_chunks(batch_size: int, ghost_batch_size: int) -> int:
    """How many ghost batches a batch of ``batch_size`` samples is normalised in:
    ``ceil(batch_size / ghost_batch_size)``, at least 1."""
    return max(1, math.ceil(batch_size / ghost_batch_size))


class _Ghost:
    """The ghost behaviour, mixed in front of a batch-norm class (what
    :func:`apply_ghost_batchnorm` makes and :func:`remove_ghost_batchnorm` undoes).
    ``ghost_batch_size`` is a plain attribute: not in the state_dict."""

    ghost_batch_size: int
    plain_class: type  # the class the layer had: set on each made class

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        plain_forward = super().forward  # type: ignore[misc]
        chunks = ghost_chunks(inputs.shape[0], self.ghost_batch_size) if self.training else 1
        if chunks == 1:
            return plain_forward(inputs)
        momentum = self.momentum  # type: ignore[attr-defined]
        # One step should move the running statistics as far as plain batch norm's one
        # update: each of the n updates gets 1/n of the momentum.
        if momentum is not None:
            self.momentum = momentum / chunks  # type: ignore[attr-defined]
        try:
            parts = [plain_forward(part) for part in inputs.tensor_split(chunks)]
        finally:
            self.momentum = momentum  # type: ignore[attr-defined]
        return torch.cat(parts)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, ghost_batch_size={self.ghost_batch_size}"  # type: ignore[misc]


class GhostBatchNorm1d(_Ghost, nn.BatchNorm1d):
    """``BatchNorm1d`` over ghost batches in training (made in place by :func:`apply_ghost_batchnorm`)."""

    plain_class = nn.BatchNorm1d


class GhostBatchNorm2d(_Ghost, nn.BatchNorm2d):
    """``BatchNorm2d`` over ghost batches in training (made in place by :func:`apply_ghost_batchnorm`)."""

    plain_class = nn.BatchNorm2d


class GhostBatchNorm3d(_Ghost, nn.BatchNorm3d):
    """``BatchNorm3d`` over ghost batches in training (made in place by :func:`apply_ghost_batchnorm`)."""

    plain_class = nn.BatchNorm3d


# Subclasses (timm's BatchNormAct2d: batch norm, then dropout and activation) keep their
# own forward, run per chunk: a ghost class is made once for each and named in this
# module, so that a pickled model finds it.
_GHOST_CLASSES: dict[type, type] = {c.plain_class: c for c in (GhostBatchNorm1d, GhostBatchNorm2d, GhostBatchNorm3d)}


def _ghost_class(cls: type) -> type:
    if cls not in _GHOST_CLASSES:
        name = f"Ghost{cls.__name__}"
        made = type(name, (_Ghost, cls), {"__module__": __name__, "__qualname__": name, "plain_class": cls})
        globals().setdefault(name, made)
        _GHOST_CLASSES[cls] = made
    return _GHOST_CLASSES[cls]


def _convertible(module: nn.Module) -> bool:
    # A lazy batch norm turns itself into its plain class at its first forward, which
    # would drop the ghost class; SyncBatchNorm is no BatchNorm1d/2d/3d.
    return (
        isinstance(module, _PLAIN_CLASSES)
        and not isinstance(module, (_Ghost, LazyModuleMixin))
    )


def apply_ghost_batchnorm(model: nn.Module, ghost_batch_size: int = 32) -> int:
    """Make every ``BatchNorm1d/2d/3d`` of ``model`` (subclasses included) normalise
    ghost batches of about ``ghost_batch_size`` samples in training, in place; returns
    how many layers of ``model`` are ghost layers afterwards (0: it has no batch norm).

    Layers change class in place: parameters, buffers, hooks and state_dict keys stay.
    Applying it again sets the new size on every ghost layer. Evaluation is unchanged.
    """
    check_value("ghost_batch_size", ghost_batch_size, low=2, whole=True)
    count = 0
    for module in list(model.modules()):
        if _convertible(module):
            module.__class__ = _ghost_class(type(module))
        if isinstance(module, _Ghost):
            module.ghost_batch_size = int(ghost_batch_size)
            count += 1
    return count


def remove_ghost_batchnorm(model: nn.Module) -> int:
    """Undo :func:`apply_ghost_batchnorm` in place: every ghost layer gets its class
    back. Returns how many layers changed."""
    count = 0
    for module in model.modules():
        if isinstance(module, _Ghost):
            module.__class__ = module.plain_class
            del module.ghost_batch_size
            count += 1
    return count


def ghost_layers(model: nn.Module) -> list[str]:
    """Names of ``model``'s ghost batch-norm layers."""
    return [name for name, m in model.named_modules() if isinstance(m, _Ghost)]


@dataclass
class GhostBatchNormConfig:
    # Samples per ghost batch, per process (each process splits its own batch).
    ghost_batch_size: int = plugin_option(32, low=2, whole=True, note="samples per ghost batch, per process")

    def __post_init__(self) -> None:
        check_plugin_options(self)


class GhostBatchNorm(Algorithm):
    """Batch norm over ghost batches of ghost_batch_size samples in training (model surgery)."""

    name = "ghost_batchnorm"
    config_class = GhostBatchNormConfig
    # Surgery first: the EMA copy, channels-last, activation checkpointing's wrappers,
    # FSDP's units and the compiled graph must all see the ghost layers.
    runs_before = ("ema", "channels_last", "activation_checkpointing", "fsdp", "torch_compile")
    conflicts_with = {
        "sync_batchnorm": (
            "ghost batch norm normalises chunks of each process's batch by themselves, sync batch norm "
            "normalises the batches of all processes together: the two ask for opposite statistics"
        ),
    }

    @hookimpl
    def init(self, state: State) -> None:
        model = state.unwrapped_model
        size = self.config.ghost_batch_size
        layers = apply_ghost_batchnorm(model, size)
        if not layers:
            raise ConfigError(
                f"ghost_batchnorm cannot change {type(model).__name__}: it has no BatchNorm1d/2d/3d layer "
                "(ghost batch norm splits batch norm's statistics; a ViT normalises with LayerNorm)"
            )
        per_process = (state.global_batch_size or 0) // max(state.world_size, 1) or None
        chunks = ghost_chunks(per_process, size) if per_process else None
        state.summary["ghost_batchnorm"] = {
            "layers": layers,
            "ghost_batch_size": size,
            "batch_size": per_process,
            "chunks": chunks,
        }
        if chunks == 1 and state.rank == 0:
            warnings.warn(
                f"ghost_batchnorm: batches of {per_process} samples per process are no larger than "
                f"ghost_batch_size={size}, so batch norm runs as plain batch norm; set a smaller ghost_batch_size",
                stacklevel=2,
            )

    def export_model(self, model: nn.Module) -> nn.Module:
        """Undone in an export: ghost layers are plain batch norm in evaluation."""
        remove_ghost_batchnorm(model)
        return model
