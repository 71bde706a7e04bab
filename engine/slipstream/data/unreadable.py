"""ImageFolder that skips unreadable images with a warning naming each file.

A corrupt or truncated file in a folder of thousands should not end a run hours
in: the item is replaced by the next readable one in the folder, and the file is
named on stderr (the first ``MAX_NAMED`` per process; the rest are counted).
A folder in which no image can be read is an error.
"""

from __future__ import annotations

import sys
from typing import Any

from torchvision import datasets

MAX_NAMED = 10  # files named per process; past that, one line says naming stopped


class SkippingImageFolder(datasets.ImageFolder):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skipped: list[str] = []  # per process: DataLoader workers keep their own

    def __getitem__(self, index: int) -> tuple[Any, int]:
        from slipstream.data.datasets import DataError  # that module builds this class: import late

        for offset in range(len(self)):
            i = (index + offset) % len(self)
            try:
                return super().__getitem__(i)
            except (OSError, SyntaxError, DataError) as exc:
                # The loader names an undecodable file in a DataError; PIL reports
                # truncated files as OSError and some corrupt headers as SyntaxError.
                self._warn(self.samples[i][0], exc)
        raise DataError(f"imagefolder: none of the {len(self)} images in {self.root} can be read")

    def _warn(self, path: str, exc: BaseException) -> None:
        self.skipped.append(path)
        if len(self.skipped) <= MAX_NAMED:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            print(
                f"slipstream: warning: skipping unreadable image {path} ({reason}); "
                "the next image in the folder is used in its place",
                file=sys.stderr,
            )
        if len(self.skipped) == MAX_NAMED:
            print(
                f"slipstream: warning: {MAX_NAMED} unreadable images named; "
                "further ones are skipped without a message",
                file=sys.stderr,
            )
