"""BlurPool (Zhang 2019, "Making convolutional networks shift-invariant again"; Composer's
BlurPool): low-pass filter before every downsampling of a CNN, so that strided
convolutions and max-pools stop aliasing. Accuracy rises a little for the same steps
(Composer: +0.5 to 1 pp top-1 on ResNet-50/ImageNet) at a small cost per step.

Model surgery at ``init``, as Composer does it (``blur_first``):

* every strided ``nn.Conv2d`` (stride > 1) with at least ``min_channels`` input
  channels blurs its input with a fixed [1, 2, 1] x [1, 2, 1] / 16 filter (depth-wise,
  stride 1, padding 1: same size), then convolves with its own stride;
* every strided ``nn.MaxPool2d`` becomes a max-pool with stride 1 followed by the blur
  with the pool's stride (``BlurMaxPool2d``).

Output shapes are unchanged. The layers change class in place (as FSDP2's
``fully_shard`` does): parameters stay the same objects (the optimizer needs no
surgery), state_dict keys and shapes stay the same (the filter is a non-persistent
buffer), so a checkpoint of a run with BlurPool loads into a model without it and the
other way round. The filter is a constant, never trained nor saved: a resumed run
rebuilds it at ``init`` and continues bit-exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from slipstream import Algorithm, ConfigError, State, check_plugin_options, check_value, hookimpl, plugin_option

__all__ = [
    "BlurConv2d",
    "BlurMaxPool2d",
    "BlurPool",
    "BlurPoolConfig",
    "apply_blurpool",
    "blur_2d",
    "blur_filter",
    "blurred_layers",
    "blurmax_pool2d",
]

_FILTER_NAME = "blur_filter"


def blur_filter(channels: int, *, like: torch.Tensor | None = None) -> torch.Tensor:
    """The depth-wise low-pass filter ``(channels, 1, 3, 3)``: [1, 2, 1] x [1, 2, 1] / 16
    (it sums to 1: a flat image stays flat), on ``like``'s device and dtype. Its second
    dimension is 1, so it is contiguous and channels-last at once: the convolution's
    output takes the input's memory format."""
    row = torch.tensor([1.0, 2.0, 1.0])
    filt = ((row[:, None] * row[None, :]) / 16.0).expand(channels, 1, 3, 3).clone()
    return filt if like is None else filt.to(device=like.device, dtype=like.dtype)


def blur_2d(inputs: torch.Tensor, filt: torch.Tensor | None = None, stride: int | tuple[int, int] = 1) -> torch.Tensor:
    """Blur ``inputs`` (N, C, H, W) per channel with ``filt`` (:func:`blur_filter`; a
    ``(1, 1, 3, 3)`` filter is used for every channel), zero padding 1, then subsample by
    ``stride``: (H, W) -> (ceil(H / s), ceil(W / s)). The output keeps the input's memory
    format. Under autocast the filter is cast with the input, as any convolution."""
    channels = inputs.shape[1]
    if filt is None:
        filt = blur_filter(channels, like=inputs)
    elif filt.shape[0] != channels:
        filt = filt.expand(channels, 1, 3, 3)
    if filt.dtype != inputs.dtype and not torch.is_autocast_enabled(inputs.device.type):
        filt = filt.to(inputs.dtype)
    return F.conv2d(inputs, filt, stride=stride, padding=1, groups=channels)


def blurmax_pool2d(
    inputs: torch.Tensor,
    kernel_size: int | tuple[int, int],
    stride: int | tuple[int, int],
    padding: int | tuple[int, int] = 0,
    dilation: int | tuple[int, int] = 1,
    filt: torch.Tensor | None = None,
) -> torch.Tensor:
    """Max-pool with stride 1, then :func:`blur_2d` with ``stride``: the output has
    ``F.max_pool2d(inputs, kernel_size, stride, padding, dilation)``'s shape."""
    maxes = F.max_pool2d(inputs, kernel_size, stride=1, padding=padding, dilation=dilation)
    return blur_2d(maxes, filt, stride)


class _Blurred:
    """Marks the blurred layer classes (what :func:`apply_blurpool` leaves alone)."""


class BlurConv2d(_Blurred, nn.Conv2d):
    """A ``Conv2d`` that blurs its input (stride 1) before convolving with its own
    stride. Made from a ``Conv2d`` by :func:`apply_blurpool`, in place; its filter is the
    non-persistent buffer ``blur_filter``."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return super().forward(blur_2d(inputs, getattr(self, _FILTER_NAME)))


class BlurMaxPool2d(_Blurred, nn.MaxPool2d):
    """A ``MaxPool2d`` that pools with stride 1, then blurs and subsamples with its own
    stride (same output shape). Its filter is the non-persistent buffer ``blur_filter``,
    one ``(1, 1, 3, 3)`` filter for every channel (a pool does not know its channels)."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return blurmax_pool2d(
            inputs, self.kernel_size, self.stride, self.padding, self.dilation, getattr(self, _FILTER_NAME)
        )


# Subclasses of Conv2d (timm's Conv2dSame, StdConv2d ...) keep their own forward: the
# blurred class is made once for each (BlurConv2d's super().forward is then the
# subclass's), and named in this module so that a pickled model finds it.
_CONV_CLASSES: dict[type, type] = {nn.Conv2d: BlurConv2d}


def _blurred_conv_class(cls: type) -> type:
    if cls not in _CONV_CLASSES:
        name = f"Blur{cls.__name__}"
        made = type(name, (BlurConv2d, cls), {"__module__": __name__, "__qualname__": name})
        globals().setdefault(name, made)
        _CONV_CLASSES[cls] = made
    return _CONV_CLASSES[cls]


def _strided(stride: int | tuple[int, ...]) -> bool:
    return max(stride if isinstance(stride, tuple) else (stride,)) > 1


def _convertible_conv(module: nn.Module, min_channels: int) -> bool:
    return (
        isinstance(module, nn.Conv2d)
        and not isinstance(module, _Blurred)
        and _strided(module.stride)
        and module.in_channels >= min_channels
        and module.padding_mode == "zeros"
    )


def _convertible_pool(module: nn.Module) -> bool:
    # ceil_mode and return_indices change the output shape or its meaning: left alone.
    return (
        type(module) is nn.MaxPool2d
        and _strided(module.stride)
        and not module.ceil_mode
        and not module.return_indices
    )


def _with_filter(module: nn.Module, channels: int, like: torch.Tensor | None) -> None:
    module.register_buffer(_FILTER_NAME, blur_filter(channels, like=like), persistent=False)


def _check_options(replace_convs: bool, replace_maxpools: bool, min_channels: int) -> None:
    for key, value in (("replace_convs", replace_convs), ("replace_maxpools", replace_maxpools)):
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false, got {value!r}")
    check_value("min_channels", min_channels, low=0, whole=True)


def apply_blurpool(
    model: nn.Module,
    *,
    replace_convs: bool = True,
    replace_maxpools: bool = True,
    min_channels: int = 16,
) -> int:
    """Add BlurPool to ``model`` in place and return how many layers were changed.

    Strided ``nn.Conv2d`` layers (and subclasses) with at least ``min_channels`` input
    channels blur their input first; strided ``nn.MaxPool2d`` layers become
    :class:`BlurMaxPool2d`. Layers change class in place: parameters, hooks, state_dict
    keys and output shapes stay the same. Already blurred layers are left alone, so a
    second call returns 0. The filter is on each layer's device and dtype; outputs keep the
    input's memory format (channels-last stays channels-last).
    """
    _check_options(replace_convs, replace_maxpools, min_channels)
    changed = 0
    for module in list(model.modules()):
        if replace_convs and _convertible_conv(module, min_channels):
            module.__class__ = _blurred_conv_class(type(module))
            _with_filter(module, module.in_channels, module.weight)
            changed += 1
        elif replace_maxpools and _convertible_pool(module):
            module.__class__ = BlurMaxPool2d
            # A pool does not know its channels: one filter, expanded at each forward.
            _with_filter(module, 1, next(model.parameters(), None))
            changed += 1
    return changed


def blurred_layers(model: nn.Module) -> list[str]:
    """Names of ``model``'s blurred layers (:class:`BlurConv2d`, :class:`BlurMaxPool2d`)."""
    return [name for name, m in model.named_modules() if isinstance(m, _Blurred)]


@dataclass
class BlurPoolConfig:
    replace_convs: bool = True  # blur before strided convolutions
    replace_maxpools: bool = True  # strided max-pools -> max-pool stride 1 + blur-downsample
    # Strided convolutions with fewer input channels (an RGB stem) are left alone, as in Composer.
    min_channels: int = plugin_option(16, low=0, whole=True, note="input channels")

    def __post_init__(self) -> None:
        check_plugin_options(self)
        if not (self.replace_convs or self.replace_maxpools):
            raise ValueError("replace_convs and replace_maxpools are both false: nothing would be blurred")


class BlurPool(Algorithm):
    """Blur before every strided convolution and max-pool of a CNN (anti-aliased downsampling)."""

    name = "blurpool"
    config_class = BlurPoolConfig
    # Surgery first: the EMA copy, channels-last, activation checkpointing, FSDP's
    # sharding and the compiled graph must all see the blurred layers.
    runs_before = ("ema", "channels_last", "activation_checkpointing", "fsdp", "torch_compile")

    def __init__(self, config: BlurPoolConfig | None = None) -> None:
        super().__init__(config)
        self.replaced = 0

    @hookimpl
    def init(self, state: State) -> None:
        cfg = self.config
        model = state.unwrapped_model
        self.replaced = apply_blurpool(
            model,
            replace_convs=cfg.replace_convs,
            replace_maxpools=cfg.replace_maxpools,
            min_channels=cfg.min_channels,
        )
        layers = blurred_layers(model)
        if not layers:
            what = " and ".join(
                w
                for w, on in (
                    (f"no strided Conv2d with at least {cfg.min_channels} input channels", cfg.replace_convs),
                    ("no strided MaxPool2d", cfg.replace_maxpools),
                )
                if on
            )
            raise ConfigError(
                f"blurpool cannot change {type(model).__name__}: it has {what} "
                "(BlurPool is for CNNs that downsample; a ViT has none)"
            )
        state.summary["blurpool"] = {"layers": len(layers), "replaced": self.replaced}

    def export_model(self, model: nn.Module) -> nn.Module:
        """Kept in an export: the weights were trained behind the blur, so removing it
        would change the network's outputs."""
        return model

