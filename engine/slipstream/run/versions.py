"""Library versions recorded in every summary and checkpoint: the engine's own
dependencies. A plugin's dependencies are its own business; its distribution and
version are recorded with the algorithm."""

from __future__ import annotations

import functools
import platform
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
    """Versions of Python and the engine's libraries, as installed when first asked."""
    return dict(_library_versions())


# Once per process: each look-up scans the installed distributions' metadata, 10-90 ms
# a run for a table that does not change while the process runs.
@functools.cache
def _library_versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in _LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found
