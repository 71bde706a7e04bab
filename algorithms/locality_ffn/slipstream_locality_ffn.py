"""Locality in the feed-forward network of a ViT (Borealis' "ViT in 24 hours", after
LocalViT): a 3x3 depth-wise convolution with h-swish between the two linear layers of
every block's MLP, so that each patch token mixes with its neighbours on the patch
grid. ViTs have no built-in notion of locality; adding it cheaply makes small ViTs
learn faster from little data and short schedules.

Model surgery at ``init``: ``block.mlp.act`` becomes a :class:`LocalityAct` that runs
the original activation, then, on the patch tokens only, reshapes them to the patch
grid, convolves, applies h-swish and flattens back. Class and register tokens
(``model.num_prefix_tokens``) bypass the convolution. The grid is read from each
input's height and width, so any input size works (an image-size curriculum,
non-square images).
"""

from __future__ import annotations

import math

import torch
from timm.layers import Mlp
from torch import nn

from slipstream import Algorithm, ConfigError, State, hookimpl


class _TokenGrid:
    """Remembers the patch grid of the latest input, for the MLP convolutions.

    Registered as a forward pre-hook on ``model.patch_embed``; a plain object (not a
    module), so the model's state_dict is unchanged and ``copy.deepcopy`` of the model
    (an EMA copy) gets its own grid, shared by its own blocks.
    """

    def __init__(self) -> None:
        self.size: tuple[int, int] | None = None

    def __call__(self, patch_embed: nn.Module, args: tuple) -> None:
        height, width = args[0].shape[-2:]
        self.size = tuple(patch_embed.dynamic_feat_size((height, width)))

    def for_tokens(self, count: int) -> tuple[int, int]:
        if self.size is None:  # blocks called without the patch embedding: a square grid
            side = math.isqrt(count)
            if side * side == count:
                return side, side
        elif self.size[0] * self.size[1] == count:
            return self.size
        raise RuntimeError(f"locality_ffn: {count} patch tokens do not form the patch grid of the input ({self.size})")


class LocalityAct(nn.Module):
    """The MLP's activation, then, on patch tokens, a 3x3 depth-wise conv and h-swish."""

    def __init__(self, act: nn.Module, channels: int, num_prefix_tokens: int, grid: _TokenGrid) -> None:
        super().__init__()
        self.act = act
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, padding=1, groups=channels)
        self.hswish = nn.Hardswish()
        self.num_prefix_tokens = num_prefix_tokens
        self.grid = grid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(x)
        prefix, patches = x[:, : self.num_prefix_tokens], x[:, self.num_prefix_tokens :]
        batch, count, channels = patches.shape
        height, width = self.grid.for_tokens(count)
        # Tokens are (B, H*W, C): viewed as (B, H, W, C) and permuted, they already are a
        # channels-last NCHW tensor, so no transposed copy is made on the way in or out.
        image = patches.reshape(batch, height, width, channels).permute(0, 3, 1, 2)
        image = self.hswish(self.conv(image))
        patches = image.permute(0, 2, 3, 1).reshape(batch, count, channels)
        return torch.cat((prefix, patches), dim=1) if self.num_prefix_tokens else patches

    def extra_repr(self) -> str:
        return f"num_prefix_tokens={self.num_prefix_tokens}"


def _mlps(model: nn.Module) -> list[Mlp]:
    blocks = getattr(model, "blocks", None)
    mlps = [getattr(block, "mlp", None) for block in blocks] if isinstance(blocks, nn.Module) else []
    usable = mlps and all(isinstance(m, Mlp) and isinstance(m.fc1, nn.Linear) for m in mlps)
    embed = getattr(model, "patch_embed", None)
    if not usable or not hasattr(embed, "dynamic_feat_size"):
        raise ConfigError(
            "locality_ffn needs a timm VisionTransformer (blocks with mlp.fc1/fc2 and a "
            f"patch_embed); {type(model).__name__} is not one"
        )
    return mlps


def add_locality(model: nn.Module) -> list[nn.Parameter]:
    """Put a 3x3 depth-wise convolution + h-swish into every block's MLP of a timm ViT,
    in place, and return the new parameters (a weight and a bias per block).

    The new modules are created on the device and dtype of the MLP. Calling it on a
    model that already has them changes nothing and returns ``[]``. Raises
    :class:`slipstream.ConfigError` for a model that is not a timm ViT.
    """
    mlps = _mlps(model)
    if any(isinstance(m.act, LocalityAct) for m in mlps):
        return []
    if getattr(getattr(model, "patch_drop", None), "prob", 0.0) > 0:
        raise ConfigError(
            "locality_ffn cannot be combined with token dropping (patch_drop_rate > 0): "
            "dropped tokens leave holes in the patch grid the convolution works on"
        )
    grid = _TokenGrid()
    model.patch_embed.register_forward_pre_hook(grid)
    prefix = int(getattr(model, "num_prefix_tokens", 1))
    new: list[nn.Parameter] = []
    for mlp in mlps:
        like = mlp.fc1.weight
        mlp.act = LocalityAct(mlp.act, mlp.fc1.out_features, prefix, grid).to(like.device, like.dtype)
        new.extend(mlp.act.conv.parameters())
    return new


def _join_group_of(optimizer: torch.optim.Optimizer, like: nn.Parameter | None, params: list) -> None:
    """Add ``params`` to the optimizer group that holds ``like`` (the first group if none
    does). Joining an existing group, rather than ``add_param_group``, keeps every LR
    scheduler built before ``init`` working: torch's schedulers fail when the number of
    groups changes under them."""
    if not params:
        return
    holds = (g for g in optimizer.param_groups if like is not None and any(p is like for p in g["params"]))
    next(holds, optimizer.param_groups[0])["params"].extend(params)


class LocalityFFN(Algorithm):
    """Locality for ViTs: a 3x3 depth-wise convolution + h-swish inside every MLP block."""

    name = "locality_ffn"
    # Surgery first: an EMA copy, activation checkpointing, channels-last and compile
    # must all see the new convolutions.
    runs_before = ("ema", "activation_checkpointing", "channels_last", "torch_compile")

    @hookimpl
    def init(self, state: State) -> None:
        model = state.unwrapped_model
        new = add_locality(model)
        # New weights train like the fc1 weights beside them and biases like its bias
        # (so weight decay follows the optimizer's own decay / no-decay split).
        fc1 = _mlps(model)[0].fc1
        _join_group_of(state.optimizer, fc1.weight, [p for p in new if p.ndim > 1])
        _join_group_of(state.optimizer, fc1.bias, [p for p in new if p.ndim <= 1])
        state.summary["locality_ffn_parameters"] = sum(p.numel() for p in new)

    def export_model(self, model: nn.Module) -> nn.Module:
        """Kept in an export: the convolutions are part of the trained network (their
        weights are learnt); removing them would change its outputs."""
        return model
