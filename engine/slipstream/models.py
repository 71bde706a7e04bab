"""Models by name from timm or torchvision, or by import path from a user's package."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import timm
import torch
import torch.nn.functional as F
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


LOSSES = ("cross_entropy", "bce")


class BinaryCrossEntropy(nn.Module):
    """timm's ``BinaryCrossEntropy`` (``loss.name=bce``): one sigmoid per class against
    one-hot targets, as ResNet strikes back and DeiT III train.

    Targets are class indices or class probabilities of the logits' shape (MixUp's and
    CutMix's soft targets). ``smoothing`` s makes them ``(1 - s) * p + s / K`` (K
    classes): timm's one-hot smoothing for indices, and for soft targets what timm's
    Mixup with ``label_smoothing`` hands its BCE (timm smooths those upstream; here the
    mixing plugins hand over unsmoothed targets, so the loss does it). Then
    ``target_threshold`` t makes each target 1 where above t, else 0 (timm's
    ``--bce-target-thresh``: both classes of a mixed pair become positives).
    ``pos_weight`` (one number, or one per class) weighs positives, ``weight`` (one per
    class) each class; ``sum_classes`` sums over classes before the batch mean.
    """

    # What the evaluation reports as this run's loss: plain cross-entropy of the logits,
    # as timm validates a BCE-trained model (services/evaluation.py reads this).
    evaluated_as_cross_entropy = True

    def __init__(
        self,
        smoothing: float = 0.0,
        target_threshold: float | None = None,
        pos_weight: float | list[float] | None = None,
        weight: list[float] | None = None,
        reduction: str = "mean",
        sum_classes: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or not 0 <= smoothing < 1:
            raise ValueError(f"smoothing must be a number in [0, 1) (0: off), got {smoothing!r}")
        if target_threshold is not None and (
            isinstance(target_threshold, bool)
            or not isinstance(target_threshold, (int, float))
            or not 0 <= target_threshold < 1
        ):
            raise ValueError(f"target_threshold must be a number in [0, 1) or null (off), got {target_threshold!r}")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be mean or sum, got {reduction!r}")
        if not isinstance(sum_classes, bool):
            raise ValueError(f"sum_classes must be true or false, got {sum_classes!r}")
        self.smoothing = float(smoothing)
        self.target_threshold = None if target_threshold is None else float(target_threshold)
        self.reduction = reduction
        self.sum_classes = sum_classes
        self.register_buffer("pos_weight", _positive_weights("pos_weight", pos_weight))
        self.register_buffer("weight", _positive_weights("weight", weight, per_class=True))

    def with_label_smoothing(self, smoothing: float) -> BinaryCrossEntropy:
        """The same loss with ``smoothing`` (what the label_smoothing plugin asks a loss for)."""
        return BinaryCrossEntropy(
            smoothing,
            self.target_threshold,
            None if self.pos_weight is None else self.pos_weight.tolist(),
            None if self.weight is None else self.weight.tolist(),
            self.reduction,
            self.sum_classes,
        )

    def check_num_classes(self, num_classes: int) -> None:
        """A ConfigError, before the run starts, where a per-class weight's length is not
        the model's class count (the first batch would fail on it)."""
        for name in ("weight", "pos_weight"):
            value = getattr(self, name)
            if value is not None and len(value) not in ((1, num_classes) if name == "pos_weight" else (num_classes,)):
                raise ConfigError(
                    f"loss.kwargs.{name} has {len(value)} entries but the model has {num_classes} classes: "
                    "give one per class"
                )

    def targets(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The per-class binary targets the loss compares ``logits`` with."""
        num_classes = logits.shape[-1]
        off = self.smoothing / num_classes
        if targets.shape != logits.shape:  # class indices: timm's smoothed one-hot, built as it does
            full = torch.full((len(targets), num_classes), off, device=logits.device, dtype=logits.dtype)
            dense = full.scatter_(1, targets.long().view(-1, 1), 1.0 - self.smoothing + off)
        else:
            dense = targets.to(logits.dtype)
            if self.smoothing:
                dense = dense * (1.0 - self.smoothing) + off
        if self.target_threshold is not None:
            dense = dense.gt(self.target_threshold).to(logits.dtype)
        return dense

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if len(logits) != len(targets):
            raise ValueError(f"bce: {len(logits)} logits rows but {len(targets)} targets")
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # soft targets and the log-sigmoid need more than 8 bits
        if self.weight is not None and self.weight.device != logits.device:
            self.weight = self.weight.to(logits.device)  # once: the engine does not move the loss
        if self.pos_weight is not None and self.pos_weight.device != logits.device:
            self.pos_weight = self.pos_weight.to(logits.device)
        loss = F.binary_cross_entropy_with_logits(
            logits,
            self.targets(logits, targets),
            self.weight,
            pos_weight=self.pos_weight,
            reduction="none" if self.sum_classes else self.reduction,
        )
        return loss.sum(-1).mean() if self.sum_classes else loss


def _positive_weights(name: str, value: Any, per_class: bool = False) -> torch.Tensor | None:
    """``value`` (null, a number or a list of numbers) as a float tensor, each weight > 0."""
    if value is None:
        return None
    numbers = [value] if isinstance(value, (int, float)) and not per_class else value
    if (
        not isinstance(numbers, (list, tuple))
        or not numbers
        or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 for v in numbers)
    ):
        shape = "a list of positive numbers, one per class" if per_class else "a positive number, or one per class"
        raise ValueError(f"{name} must be {shape} (or null), got {value!r}")
    return torch.tensor([float(v) for v in numbers])


def build_loss(name: str = "cross_entropy", **kwargs: Any) -> Any:
    """The training loss, called as ``loss(outputs, targets)``: ``cross_entropy``
    (``torch.nn.CrossEntropyLoss(**kwargs)``, e.g. ``label_smoothing``), ``bce``
    (:class:`BinaryCrossEntropy`: ``smoothing``, ``target_threshold``, ``pos_weight``,
    ``weight``, ``reduction``, ``sum_classes``) or an import path to a class (built with
    ``kwargs``) or a function (``kwargs`` bound to it)."""
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
    if name == "bce":
        known = list(inspect.signature(BinaryCrossEntropy).parameters)
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            raise ConfigError(
                f"loss.kwargs.{unknown[0]} is not an option of loss.name=bce{did_you_mean(unknown[0], known)}; "
                f"its options: {', '.join(known)}"
            )
        try:
            return BinaryCrossEntropy(**kwargs)
        except ValueError as exc:
            raise ConfigError(f"loss.name=bce: loss.kwargs.{exc}") from None
    raise ConfigError(
        f"loss.name {name!r} is not supported; use {', '.join(LOSSES)} or an import path "
        "('package.module:name') to a loss class or function"
    )
