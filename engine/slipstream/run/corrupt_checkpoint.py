"""Why a file given as a checkpoint could not be read, in a user's words.

torch's reader says it in its own terms: a zip library's error with a raw code
(``... (101)``), a paragraph on ``weights_only=False`` for a YAML file (advice that
would run arbitrary code, and would not make a config a checkpoint), or nothing at
all (``EOFError`` for an empty file). :func:`unreadable_reason` looks at the file.
"""

from __future__ import annotations

import re
from pathlib import Path

from slipstream.errors import first_line

_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_MAGIC = b"\x80"  # a pickle of protocol 2 or more: torch's legacy (pre-1.6) format

# miniz's messages (torch's zip reader) -> what they mean for the file.
_ZIP_ERRORS = (
    ("failed finding central directory", "the file is cut short (its zip archive has no directory at the end: "
     "a copy or a save that did not finish)"),
    ("invalid header or archive is corrupted", "the file is damaged (a part of its zip archive is unreadable)"),
    ("file read failed", "the file is damaged or cut short (a part of it could not be read)"),
    ("unexpected decompressed size", "the file is damaged (its data does not match its sizes)"),
    ("crc", "the file is damaged (its data does not match its checksums)"),
    ("decompression failed", "the file is damaged (its data cannot be decompressed)"),
    ("file not found", "the file is damaged or not a checkpoint (a part every checkpoint holds is missing)"),
)


def unreadable_reason(path: str | Path, exc: BaseException) -> str:
    """Why ``path`` is no checkpoint torch can read, ``exc`` being what torch.load raised."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(4096)
    except OSError:
        size, head = None, b""
    if size == 0:
        return "the file is empty (0 bytes)"
    if head and not head.startswith((_ZIP_MAGIC, _PICKLE_MAGIC)):
        kind = _text_kind(head, path)
        if kind is not None:
            return f"this is {kind}, not a checkpoint; give a .pt file from a run's checkpoints folder"
        return "it is not a PyTorch checkpoint (it is no zip archive, as torch.save writes)"
    text = " ".join(str(exc).split()).lower()
    for marker, reason in _ZIP_ERRORS:
        if marker in text:
            return reason
    if isinstance(exc, EOFError) or "ran out of input" in text:
        return "the file is cut short"
    if "weights only load failed" in text or "unpickling" in text:
        return ("its contents are damaged, or Python objects besides tensors that Slipstream does not load "
                "(loading them could run any code): it is not a readable Slipstream checkpoint")
    first = first_line(exc)
    first = first.split(". This is an internal miniz error")[0]
    return re.sub(r"\s*\(\d+\)\s*$", "", first)[:200]  # a raw library error code says nothing


def _text_kind(head: bytes, path: Path) -> str | None:
    """``a YAML file``, ``a JSON file``, ``a text file`` or None for binary ``head``."""
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if "\0" in text:
        return None
    stripped = text.lstrip()
    if path.suffix.lower() in (".yaml", ".yml") or re.match(r"^(---|[A-Za-z_][\w.-]*:(\s|$))", stripped):
        return "a YAML file (a config or a recipe?)"
    if path.suffix.lower() in (".json", ".jsonl") or stripped.startswith(("{", "[")):
        return "a JSON file"
    return "a text file"
