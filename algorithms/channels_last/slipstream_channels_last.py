"""Channels-last (NHWC) memory format for convolutional networks.

oneDNN on CPU and cuDNN on tensor-core GPUs run 2-D convolutions fastest on NHWC
data; in the default NCHW layout they reorder every activation before and after
each convolution. Converting the weights once and every input batch keeps the whole
network in NHWC: element-wise ops, batch norm and pooling preserve the memory format
of their input. The plugin converts no batch itself: it sets
``state.input_memory_format``, and the engine writes each batch in that format in the
same pass that converts it to float and normalises it, after every batch transform.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slipstream import Algorithm, State, Variant, hookimpl

MODES = ("auto", "always")


@dataclass
class ChannelsLastConfig:
    warn_without_conv: bool = True  # warn when the model has no 2-D convolution to speed up
    # auto: the engine times a few training steps of the run's own model in NHWC and in
    # NCHW at fit start and keeps the faster (trainer.autotune, docs/auto.md);
    # always: channels-last whatever the measurement would say.
    mode: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            # YAML reads on/yes as true: say so rather than leave a puzzling 'True'.
            hint = " (YAML reads on/off as true/false)" if str(self.mode) in ("True", "False") else ""
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}{hint}")


def apply_channels_last(model: nn.Module) -> nn.Module:
    """Convert ``model``'s 4-D parameters and buffers to channels-last, in place.

    Parameters keep their identity (``Module.to`` swaps their data), so an optimizer
    built before the conversion still holds the right tensors. Returns ``model``.
    """
    return model.to(memory_format=torch.channels_last)


def to_channels_last(inputs: Any) -> Any:
    """``inputs`` in channels-last when it is a 4-D tensor; anything else unchanged.

    A tensor that is already channels-last is returned as is (no copy).
    """
    if isinstance(inputs, torch.Tensor) and inputs.dim() == 4:
        return inputs.contiguous(memory_format=torch.channels_last)
    return inputs


def batch_to_channels_last(batch: Any) -> Any:
    """A ``(inputs, targets, ...)`` batch with its inputs in channels-last.

    Only the first element is converted: targets are never images fed to a
    convolution. A bare tensor is treated as the inputs.
    """
    if isinstance(batch, (tuple, list)) and batch:
        return type(batch)((to_channels_last(batch[0]), *batch[1:]))
    return to_channels_last(batch)


def conv2d_layers(model: nn.Module) -> list[nn.Module]:
    """The 2-D convolutions of ``model`` (the layers channels-last speeds up)."""
    return [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d))]


def _is_patchify(conv: nn.Module) -> bool:
    # A non-overlapping patch embedding (kernel == stride, no padding), as in a
    # ViT's stem: one small convolution whose layout barely matters.
    return conv.kernel_size == conv.stride and conv.padding in (0, (0, 0))


class ChannelsLast(Algorithm):
    """Channels-last (NHWC) memory format for the model and its input batches."""

    name = "channels_last"
    config_class = ChannelsLastConfig

    def __init__(self, config: ChannelsLastConfig | None = None) -> None:
        super().__init__(config)
        self.active = False

    def variants(self, state: State) -> list[Variant]:
        """mode auto on a model with 2-D convolutions: NHWC (the fallback) or NCHW,
        whichever trains the run's step faster. Same values either way: no margin."""
        if self.config.mode != "auto" or not conv2d_layers(state.unwrapped_model):
            return []
        return [Variant("nhwc"), Variant("nchw")]

    @hookimpl
    def init(self, state: State) -> None:
        if self.variant == "nchw" and self.config.mode == "auto":
            return  # NCHW was faster for this model here: the engine's auto line says so
        convs = conv2d_layers(state.unwrapped_model)
        if not convs:
            if self.config.warn_without_conv:
                warnings.warn(
                    "channels_last: the model has no 2-D convolution, so channels-last "
                    "cannot speed it up; leaving the model and its inputs as they are",
                    stacklevel=1,
                )
            return
        if self.config.warn_without_conv and all(_is_patchify(c) for c in convs):
            warnings.warn(
                "channels_last: the model's only convolutions are patch embeddings "
                "(a ViT-like model), so channels-last is unlikely to speed it up",
                stacklevel=1,
            )
        apply_channels_last(state.model)
        # The engine converts every batch (training and evaluation) to this format
        # after all batch transforms, in the pass that normalises it: no extra copy.
        state.input_memory_format = torch.channels_last
        self.active = True

    def export_model(self, model: nn.Module) -> nn.Module:
        """Kept in an export: NHWC weights give the same results on NCHW inputs, and
        an inference runtime that prefers NHWC (oneDNN, cuDNN) gets them as trained."""
        return model
