"""Library versions recorded in every summary and checkpoint: the engine's own
dependencies. A plugin's dependencies are its own business; its distribution and
version are recorded with the algorithm."""

from __future__ import annotations

import platform
from functools import lru_cache
from importlib import metadata

_LIBRARIES = (
    "slipstream",
    "torch",
    "torchvision",
    "timm",
    "pluggy",
    "omegaconf",
    "numpy",
)


def library_versions() -> dict[str, str]:
    return dict(_library_versions())


@lru_cache(maxsize=1)  # read from the installed metadata once per process: it does not change
def _library_versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in _LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found
