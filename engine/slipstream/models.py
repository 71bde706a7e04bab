"""Models by name from timm or torchvision."""

from __future__ import annotations

from typing import Any

import timm
import torchvision
from torch import nn

from .errors import ConfigError, did_you_mean


def _timm_names() -> list[str]:
    return timm.list_models()


def _torchvision_names() -> list[str]:
    return torchvision.models.list_models(module=torchvision.models)


def apply_cifar_stem(model: nn.Module) -> nn.Module:
    """A 3x3 stride-1 stem without max-pool, so a ResNet keeps its resolution at 32 px."""
    conv = getattr(model, "conv1", None)
    if not isinstance(conv, nn.Conv2d):
        raise ConfigError(
            "model.cifar_stem needs a ResNet-style model with a `conv1` convolution; "
            f"{type(model).__name__} has none"
        )
    model.conv1 = nn.Conv2d(conv.in_channels, conv.out_channels, 3, stride=1, padding=1, bias=False)
    if hasattr(model, "maxpool"):
        model.maxpool = nn.Identity()
    return model


def build_model(
    name: str,
    num_classes: int,
    *,
    image_size: int | None = None,
    cifar_stem: bool = False,
    pretrained: bool = False,
    **kwargs: Any,
) -> nn.Module:
    """``name`` is a timm model, a torchvision model, or either with a ``timm/`` or
    ``torchvision/`` prefix to choose. timm ViTs are built with ``dynamic_img_size``
    so an image-size curriculum needs no parameter surgery."""
    source, _, bare = name.rpartition("/")
    if source not in ("", "timm", "torchvision"):
        raise ConfigError(f"model.name {name!r}: the prefix must be 'timm/' or 'torchvision/'")
    if source in ("", "timm") and timm.is_model(bare):
        model = _build_timm(bare, num_classes, image_size, pretrained, kwargs)
    elif source in ("", "torchvision") and bare in _torchvision_names():
        weights = "DEFAULT" if pretrained else None
        model = torchvision.models.get_model(
            bare, weights=weights, num_classes=num_classes, **kwargs
        )
    else:
        names = _timm_names() + _torchvision_names()
        raise ConfigError(
            f"unknown model {name!r}{did_you_mean(bare, names)}; use a timm or torchvision "
            "model name (`python -c 'import timm; print(timm.list_models())'` lists timm's)"
        )
    if cifar_stem:
        apply_cifar_stem(model)
    return model


# timm modules whose models take `img_size` and `dynamic_img_size`.
_VIT_MODULES = ("vision_transformer", "deit", "eva", "beit", "vision_transformer_relpos")


def is_timm_vit(name: str) -> bool:
    entrypoint = timm.models.model_entrypoint(name)
    return entrypoint.__module__.rsplit(".", 1)[-1] in _VIT_MODULES


def _build_timm(
    name: str, num_classes: int, image_size: int | None, pretrained: bool, kwargs: dict
) -> nn.Module:
    kwargs = dict(kwargs)
    if is_timm_vit(name):
        kwargs.setdefault("dynamic_img_size", True)
        if image_size is not None:
            kwargs.setdefault("img_size", image_size)
    try:
        return timm.create_model(name, pretrained=pretrained, num_classes=num_classes, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"model {name!r} does not accept these model.kwargs: {exc}") from None


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
