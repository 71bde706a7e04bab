"""Stochastic depth: residual blocks dropped per sample during training.

Each residual block's branch is multiplied, in training, by a per-sample Bernoulli
keep mask divided by the keep probability, so a dropped sample passes through the
block as its shortcut alone and the expected output is unchanged (Huang et al. 2016,
"Deep Networks with Stochastic Depth"; timm's ``drop_path``, per sample). The drop
rate rises linearly over depth, from 0 at the first block to ``drop_rate`` at the
last (timm's rule). Evaluation is the identity: nothing is dropped or scaled.

Where the drop goes, at ``init`` (model surgery, before any wrapping):

- timm models whose blocks have a ``drop_path`` attribute (ResNets, ConvNeXt,
  EfficientNet) or ``drop_path1`` / ``drop_path2`` (ViTs): that attribute becomes
  a :class:`DropPath` of the block's rate, in place of timm's ``DropPath`` (which
  draws from torch's global RNG) or of ``None`` / ``Identity``;
- torchvision ResNets (``BasicBlock``, ``Bottleneck``): a :class:`DropPath` after
  the branch's last batch norm (a forward hook on ``bn2`` / ``bn3``, so the
  residual add sees the dropped branch), kept as the block's ``drop_path``.

Neither adds a parameter or a buffer: state dicts and checkpoints are the model's
own, and load with or without the plugin.

Randomness: the plugin draws every block's mask for a batch at ``before_forward``,
all at once, from a ``torch.Generator`` on the run's device reseeded with
``slipstream.batch_seed(seed, rank, batch, "stochastic_depth")``. The global RNG is
never touched, a run resumed mid-epoch continues exactly (nothing to checkpoint),
and a forward recomputed in backward (activation checkpointing) drops the same
samples as the first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slipstream import Algorithm, ConfigError, State, batch_seed, check_plugin_options, hookimpl, plugin_option

# The block attributes timm's residual blocks apply to their branches.
TIMM_ATTRS = (("drop_path",), ("drop_path1", "drop_path2"))


@dataclass
class StochasticDepthConfig:
    # the last block's drop rate; the first block's is 0, those between rise linearly
    drop_rate: float = plugin_option(
        0.1, low=0, high=1, high_open=True, note="the last block's rate; 0 = nothing dropped"
    )

    def __post_init__(self) -> None:
        check_plugin_options(self)


def keep_mask(
    n: int, drop_prob: float, generator: torch.Generator | None = None, device: Any = None
) -> torch.Tensor:
    """``n`` per-sample multipliers: ``1 / keep_prob`` with probability ``keep_prob``
    (``1 - drop_prob``), else 0; drawn with ``generator`` (on its device) when given,
    else from torch's global RNG on ``device``."""
    keep = 1.0 - drop_prob
    where = generator.device if generator is not None else device
    u = torch.rand(n, generator=generator, device=where)
    return (u < keep).float().div_(keep)


class DropPath(nn.Module):
    """Per-sample drop of a residual branch: ``x * mask / keep_prob`` in training, the
    identity in eval (timm's ``DropPath`` with ``scale_by_keep``).

    The mask is the one ``mask`` holds (``(N,)``, set for the batch by the plugin)
    when it fits ``x``'s batch and device; otherwise it is drawn now from
    ``generator`` (the plugin's, reseeded every batch) or, with none, from torch's
    global RNG as timm does. No parameters or buffers.
    """

    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        self.drop_prob = float(drop_prob)
        self.mask: torch.Tensor | None = None
        self.generator: torch.Generator | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.drop_prob == 0.0:
            return x
        mask = self.mask
        if mask is None or mask.shape[0] != x.shape[0] or mask.device != x.device:
            mask = keep_mask(x.shape[0], self.drop_prob, self.generator, x.device).to(x.device)
        return x * mask.to(x.dtype).view(-1, *([1] * (x.ndim - 1)))

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob:.3f}"


class _DropBranch:
    """A forward hook on a torchvision block's last batch norm: its output (the
    residual branch, before the add) goes through the block's :class:`DropPath`.
    An object, not a function, so copies of the model (EMA, the FLOP counter's meta
    copy) carry it."""

    def __init__(self, drop_path: DropPath) -> None:
        self.drop_path = drop_path

    def __call__(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return self.drop_path(output)


def _torchvision_blocks() -> tuple[type, ...]:
    try:
        from torchvision.models.resnet import BasicBlock, Bottleneck
    except ImportError:  # torchvision is optional: timm models need none of it
        return ()
    return (BasicBlock, Bottleneck)


def residual_blocks(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """The residual blocks stochastic depth can drop, in depth order (module order),
    each with how: ``"torchvision"`` (a ``BasicBlock``/``Bottleneck``) or the
    comma-joined timm attributes (``"drop_path"``, ``"drop_path1,drop_path2"``)."""
    tv = _torchvision_blocks()
    found: list[tuple[nn.Module, str]] = []
    for module in model.modules():
        if tv and isinstance(module, tv):
            found.append((module, "torchvision"))
            continue
        for attrs in TIMM_ATTRS:
            if all(_droppable(module, a) for a in attrs):
                found.append((module, ",".join(attrs)))
                break
    return found


def _droppable(module: nn.Module, attr: str) -> bool:
    # timm leaves None (ResNet) or nn.Identity (ViT, ConvNeXt) where the rate is 0.
    if not hasattr(module, attr) or isinstance(module, DropPath):
        return False
    value = getattr(module, attr)
    return value is None or isinstance(value, (nn.Identity, DropPath)) or type(value).__name__ == "DropPath"


def linear_rates(n: int, drop_rate: float) -> list[float]:
    """``n`` blocks' rates rising linearly from 0 (the first) to ``drop_rate`` (the
    last), timm's ``linspace(0, drop_path_rate, depth)``; one block gets ``drop_rate``."""
    if n == 1:
        return [float(drop_rate)]
    return [drop_rate * i / (n - 1) for i in range(n)]


def _last_bn(block: nn.Module) -> nn.Module:
    return block.bn3 if hasattr(block, "bn3") else block.bn2


def apply_stochastic_depth(model: nn.Module, drop_rate: float = 0.1) -> int:
    """Drop ``model``'s residual blocks per sample in training, at rates rising
    linearly over depth from 0 to ``drop_rate`` (the last block's), in place.

    Returns the number of blocks changed (those with a rate above 0; with the first
    at 0, one fewer than the model's blocks). Applying it again sets the new rates.
    Without the plugin, masks are drawn from torch's global RNG as timm's are; set
    ``generator`` on the :class:`DropPath` modules (:func:`drop_paths`) to draw from
    one of your own. Raises :class:`slipstream.ConfigError` naming the model when it
    has no block this knows (see :func:`residual_blocks`).
    """
    if not 0 <= drop_rate < 1:
        raise ValueError(f"drop_rate must be in [0, 1), got {drop_rate}")
    blocks = residual_blocks(model)
    if not blocks:
        raise ConfigError(
            f"algorithms.stochastic_depth: cannot change {type(model).__name__}: it has no residual block "
            "it knows (torchvision BasicBlock/Bottleneck; timm blocks with drop_path or "
            "drop_path1/drop_path2, as timm's ResNets and ViTs)"
        )
    remove_stochastic_depth(model)
    changed = 0
    for (block, how), rate in zip(blocks, linear_rates(len(blocks), drop_rate), strict=True):
        if rate <= 0:
            continue
        changed += 1
        if how == "torchvision":
            block.drop_path = DropPath(rate).train(block.training)
            _last_bn(block).register_forward_hook(_DropBranch(block.drop_path))
        else:
            for attr in how.split(","):
                setattr(block, attr, DropPath(rate).train(block.training))
    return changed


def drop_paths(model: nn.Module) -> list[DropPath]:
    """The :class:`DropPath` modules of ``model``, in depth order."""
    return [m for m in model.modules() if isinstance(m, DropPath)]


def remove_stochastic_depth(model: nn.Module) -> int:
    """Undo :func:`apply_stochastic_depth` in place: timm blocks get ``nn.Identity``
    where a :class:`DropPath` was, torchvision blocks lose the hook and their
    ``drop_path``. Returns the number of :class:`DropPath` modules removed."""
    removed = 0
    for module in list(model.modules()):
        for key, hook in list(module._forward_hooks.items()):
            if isinstance(hook, _DropBranch):
                del module._forward_hooks[key]
        for name, child in list(module.named_children()):
            if isinstance(child, DropPath):
                removed += 1
                if name == "drop_path" and isinstance(module, _torchvision_blocks() or ()):
                    delattr(module, name)
                else:
                    setattr(module, name, nn.Identity().train(module.training))
    return removed


class StochasticDepth(Algorithm):
    """Stochastic depth: residual blocks dropped per sample, rate rising linearly over depth."""

    name = "stochastic_depth"
    config_class = StochasticDepthConfig
    # Surgery first: EMA's copy, activation checkpointing's wrappers, FSDP's units and
    # the compiled graph must all see the DropPath modules.
    runs_before = ("ema", "activation_checkpointing", "fsdp", "torch_compile")

    def __init__(self, config: StochasticDepthConfig | None = None) -> None:
        super().__init__(config)
        self.paths: list[DropPath] = []
        self.generator: torch.Generator | None = None
        self._keep: torch.Tensor | None = None

    @hookimpl
    def init(self, state: State) -> None:
        model = state.unwrapped_model
        changed = apply_stochastic_depth(model, self.config.drop_rate)
        self.paths = drop_paths(model)
        self.generator = torch.Generator(device=state.device)
        for path in self.paths:
            path.generator = self.generator
        # One row per DropPath (a ViT block has two, dropped independently as in timm).
        self._keep = torch.tensor([1.0 - p.drop_prob for p in self.paths], device=state.device)[:, None]
        state.summary["stochastic_depth"] = {
            "blocks": changed,
            "drop_rates": [round(p.drop_prob, 6) for p in self.paths],
        }

    @hookimpl
    def before_forward(self, state: State) -> None:
        if not self.paths:
            return
        assert self.generator is not None and self._keep is not None
        self.generator.manual_seed(batch_seed(state.seed, state.rank, state.timestamp.batch, self.name))
        inputs = state.batch[0] if isinstance(state.batch, (tuple, list)) else state.batch
        n = inputs.shape[0]
        u = torch.rand((len(self.paths), n), generator=self.generator, device=self.generator.device)
        masks = (u < self._keep).float().div_(self._keep)
        for path, mask in zip(self.paths, masks, strict=True):
            path.mask = mask

    @hookimpl
    def batch_end(self, state: State) -> None:
        for path in self.paths:
            path.mask = None  # a forward outside the batch draws its own

    def export_model(self, model: nn.Module) -> nn.Module:
        """Undone in an export: dropping only serves training (eval is the identity)."""
        remove_stochastic_depth(model)
        return model
