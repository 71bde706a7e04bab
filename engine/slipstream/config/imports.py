"""Objects named by an import path in a config (``my_package.models:build_net``):
a user's own model, optimizer or loss next to the built-in names."""

from __future__ import annotations

import importlib
from typing import Any

from slipstream.errors import ConfigError


def is_import_path(name: str) -> bool:
    """``pkg.mod:attr`` (the form of an entry point), which no timm, torchvision or
    built-in name has."""
    return isinstance(name, str) and ":" in name


def import_object(path: str, key: str) -> Any:
    """The object at ``path`` (``pkg.mod:attr.sub``), or a ConfigError naming ``key``
    and the path when the module or the attribute cannot be found."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{key}={path!r}: an import path looks like 'package.module:name'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{key}={path!r}: cannot import module {module_name!r} ({exc}); is it installed "
            "or on PYTHONPATH?"
        ) from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{key}={path!r}: module {module_name!r} has no {attr!r}") from None
    return obj


def call_with(obj: Any, key: str, path: str, **kwargs: Any) -> Any:
    """``obj(**kwargs)``, a TypeError (a wrong keyword) reported as a ConfigError."""
    if not callable(obj):
        raise ConfigError(f"{key}={path!r} is not callable")
    try:
        return obj(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{key}={path!r} cannot be called with {sorted(kwargs)}: {exc}") from None
