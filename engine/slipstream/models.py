"""Models by name from timm or torchvision, or by import path from a user's package."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import timm
import torchvision
from torch import nn

from slipstream.config.imports import call_with, import_object, is_import_path
from slipstream.errors import ConfigError, SlipstreamError, describe, did_you_mean, network_failure


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
    so an image-size curriculum needs no parameter surgery.

    ``name`` may also be an import path, ``my_package.models:build_net``: a function
    (or class) called with ``num_classes`` and ``kwargs`` (and ``image_size`` and
    ``pretrained`` where it takes them) that returns an ``nn.Module``."""
    if is_import_path(name):
        model = _build_imported(name, num_classes, image_size, pretrained, kwargs)
        return apply_cifar_stem(model) if cifar_stem else model
    source, _, bare = name.rpartition("/")
    if source not in ("", "timm", "torchvision"):
        raise ConfigError(f"model.name {name!r}: the prefix must be 'timm/' or 'torchvision/'")
    if source in ("", "timm") and timm.is_model(bare):
        library = "timm"
    elif source in ("", "torchvision") and bare in _torchvision_names():
        library = "torchvision"
    else:
        names = _timm_names() + _torchvision_names()
        raise ConfigError(
            f"unknown model {name!r}{did_you_mean(bare, names)}; use a timm or torchvision "
            "model name (`python -c 'import timm; print(timm.list_models())'` lists timm's)"
        )
    try:
        if library == "timm":
            model = _build_timm(bare, num_classes, image_size, pretrained, kwargs)
        else:
            weights = "DEFAULT" if pretrained else None
            model = torchvision.models.get_model(
                bare, weights=weights, num_classes=num_classes, **kwargs
            )
    except Exception as exc:  # the library's own errors, whatever their type
        raise _model_error(exc, f"{library}/{bare}", num_classes, pretrained, kwargs) from None
    if cifar_stem:
        apply_cifar_stem(model)
    return model


def _build_imported(
    path: str, num_classes: int, image_size: int | None, pretrained: bool, kwargs: dict[str, Any]
) -> nn.Module:
    build = import_object(path, "model.name")
    given = {"num_classes": num_classes, **kwargs}
    try:
        params = inspect.signature(build).parameters
    except (TypeError, ValueError):  # a builtin without a signature: pass the minimum
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for key, value in (("image_size", image_size), ("pretrained", pretrained)):
        if key in params or (takes_any and key == "pretrained" and pretrained):
            given.setdefault(key, value)
    if pretrained and "pretrained" not in given:
        raise ConfigError(f"model.name={path!r} takes no 'pretrained' argument; set model.pretrained=false")
    model = call_with(build, "model.name", path, **given)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model.name={path!r} returned {type(model).__name__}, not a torch.nn.Module"
        )
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
    return timm.create_model(name, pretrained=pretrained, num_classes=num_classes, **kwargs)


def _model_error(
    exc: Exception, name: str, num_classes: int, pretrained: bool, kwargs: dict[str, Any]
) -> SlipstreamError:
    """One clear message for whatever timm or torchvision raised."""
    if isinstance(exc, SlipstreamError):
        return exc
    if pretrained and network_failure(exc) is not None:
        return ConfigError(
            f"model {name}: cannot download its pretrained weights: there is no network "
            f"({describe(network_failure(exc))}). Offline, set model.pretrained=false, or "
            "fetch the weights on a connected machine into the cache this machine uses "
            "(HF_HOME for timm, TORCH_HOME for torchvision) and, for timm, set HF_HUB_OFFLINE=1"
        )
    given = f"num_classes={num_classes}" + (", pretrained weights" if pretrained else "")
    given += f", model.kwargs={kwargs}" if kwargs else ""
    if isinstance(exc, MemoryError):
        return ConfigError(f"model {name}: not enough memory to build it with {given}")
    if isinstance(exc, (TypeError, ValueError, AssertionError, RuntimeError, KeyError)):
        return ConfigError(f"model {name} cannot be built with {given}: {describe(exc)}")
    raise exc


LOSSES = ("cross_entropy",)


def build_loss(name: str = "cross_entropy", **kwargs: Any) -> Any:
    """The training loss, called as ``loss(outputs, targets)``: ``cross_entropy``
    (``torch.nn.CrossEntropyLoss(**kwargs)``, e.g. ``label_smoothing``) or an import
    path to a class (built with ``kwargs``) or a function (``kwargs`` bound to it)."""
    if is_import_path(name):
        obj = import_object(name, "loss.name")
        if isinstance(obj, type):
            return call_with(obj, "loss.name", name, **kwargs)
        if not callable(obj):
            raise ConfigError(f"loss.name={name!r} is not callable")
        return functools.partial(obj, **kwargs) if kwargs else obj
    if name == "cross_entropy":
        try:
            return nn.CrossEntropyLoss(**kwargs)
        except TypeError as exc:
            raise ConfigError(f"loss.kwargs={kwargs}: {exc}") from None
    raise ConfigError(
        f"loss.name {name!r} is not supported; use {', '.join(LOSSES)} or an import path "
        "('package.module:name') to a loss class or function"
    )
