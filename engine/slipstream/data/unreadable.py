"""ImageFolder that skips unreadable images with a warning naming each file.

A corrupt or truncated file in a folder of thousands should not end a run hours
in: the item is replaced by the next readable one of its class's folder (so its
label stays true; an evaluation's split leaves it out of its batch instead), and the
file is named on stderr once (``slipstream.data.decode.SkipLog``: the first 10 files
per process). A class folder in which no image can be read is an error.
"""

from __future__ import annotations

from typing import Any

from torchvision import datasets

from slipstream.data.decode import SkipLog
from slipstream.data.geometry import Geometry
from slipstream.errors import DataError


class SkippingImageFolder(datasets.ImageFolder):
    """``replace=False`` (an evaluation's split): an unreadable image is left out of its
    batch instead of replaced, since a stand-in would be evaluated, and counted, twice.
    (A batch none of whose images can be read still gets stand-ins: a batch of none is
    no batch.)"""

    def __init__(self, root: str, geometry: Geometry, *, replace: bool = True) -> None:
        # Files are opened by the geometry, which crops while it decodes (the loader
        # only names them).
        super().__init__(root, loader=str)
        self.geometry = geometry
        self.keyed = geometry.random  # build_loader's sampler gives keys with the epoch
        self.replace = replace
        # per process: DataLoader workers keep their own
        self.log = SkipLog("image's class" if replace else None)
        # Each class's items are contiguous (ImageFolder sorts by class): [start, stop).
        self._spans: dict[int, tuple[int, int]] = {}
        for i, target in enumerate(self.targets):
            start, _ = self._spans.get(target, (i, i))
            self._spans[target] = (start, i + 1)

    def _load(self, i: int, key: int) -> tuple[Any, int]:
        """Image ``i``, cut with the random draws of sample ``key`` (a stand-in keeps them)."""
        path, target = self.samples[i]
        return self.geometry.load(path, key), target

    @property
    def skipped(self) -> list[str]:
        return self.log.skipped

    def __getitems__(self, indices: list[int]) -> list[tuple[Any, int]]:
        """A batch's items (the DataLoader asks for them together): without the
        unreadable ones where ``replace`` is off."""
        if self.replace:
            return [self[i] for i in indices]
        items = []
        for i in indices:
            try:
                items.append(self._load(i, i))
            except (OSError, SyntaxError, DataError) as exc:
                self.log.warn(self.samples[i][0], " ".join(str(exc).split()) or type(exc).__name__)
        return items or [self[i] for i in indices]

    def __getitem__(self, index: int) -> tuple[Any, int]:
        target = self.targets[index]
        start, stop = self._spans[target]
        size = stop - start
        for offset in range(size):
            i = start + (index - start + offset) % size
            try:
                return self._load(i, index)
            except (OSError, SyntaxError, DataError) as exc:
                # The loader names an undecodable file in a DataError; PIL reports
                # truncated files as OSError and some corrupt headers as SyntaxError.
                self.log.warn(self.samples[i][0], " ".join(str(exc).split()) or type(exc).__name__)
        raise DataError(
            f"imagefolder: none of the {size} images of class {self.classes[target]!r} in {self.root} can be "
            "read, so the class cannot be trained on; replace them, or remove the class's folder"
        )
