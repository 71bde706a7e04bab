"""Errors that the CLI reports as one clear message instead of a traceback."""

from __future__ import annotations

import difflib
import errno
from collections.abc import Iterable


class SlipstreamError(Exception):
    """A user-facing error: bad config, unknown algorithm, corrupt checkpoint, ..."""


class ConfigError(SlipstreamError, ValueError):
    """The configuration, a recipe or an algorithm's options are invalid."""


class PluginError(SlipstreamError):
    """A plugin could not be found, loaded, ordered or combined."""


class CheckpointError(SlipstreamError):
    """A checkpoint could not be read or does not fit the run."""


class DataError(SlipstreamError, ValueError):
    """A dataset cannot be built as configured (unknown name, missing files, bad layout)."""


class ResultsError(SlipstreamError, ValueError):
    """A run directory is missing, not a run directory, or holds unreadable files."""


class ConfigWarning(UserWarning):
    """A setting that would have no effect (the CLI prints these as warnings)."""


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice most like ``word`` (the case of letters aside), or None.

    >>> closest("EMA", ["ema", "mixup"]), closest("mixp", ["ema", "mixup"]), closest("zzz", ["ema"])
    ('ema', 'mixup', None)
    """
    choices = list(choices)
    by_lower = {c.lower(): c for c in choices}
    if word.lower() in by_lower:
        return by_lower[word.lower()]
    matches = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.5)
    return by_lower[matches[0]] if matches else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    match = closest(word, choices)
    return f" (did you mean {match!r}?)" if match else ""


def describe(exc: BaseException) -> str:
    """An exception as one line: its first line of text, or its type's name."""
    text = str(exc)
    if "Original Traceback" in text:
        # Re-raised from a DataLoader worker: the worker's traceback is in the
        # text, and its last line is the error itself.
        text = text.strip().splitlines()[-1]
    text = " ".join(text.split())
    return text[:300] if text else type(exc).__name__


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type's name when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def omegaconf_problem(exc: BaseException) -> tuple[str, str]:
    """``(key, first line of the message)`` of one of omegaconf's errors (read off its
    attributes: this module imports no config library)."""
    key = getattr(exc, "full_key", None) or getattr(exc, "key", None) or "?"
    return str(key), first_line(exc)


def exception_chain(exc: BaseException) -> Iterable[BaseException]:
    """``exc`` and the exceptions it was raised from or during, each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def network_failure(exc: BaseException) -> BaseException | None:
    """The network error behind ``exc`` (DNS, refused or reset connection, timeout,
    HTTP library or Hugging Face offline errors), or None if it is not one."""
    import socket
    import urllib.error

    kinds: list[type] = [urllib.error.URLError, socket.gaierror, ConnectionError, TimeoutError]
    try:
        import requests

        kinds.append(requests.exceptions.ConnectionError)
        kinds.append(requests.exceptions.Timeout)
    except ImportError:
        pass
    try:
        from huggingface_hub import errors as hf_errors

        # Raised when the hub is unreachable and the file is not in the local cache.
        kinds += [hf_errors.LocalEntryNotFoundError, hf_errors.OfflineModeIsEnabled]
    except ImportError:
        pass
    try:
        import httpx

        kinds += [httpx.TransportError]
    except ImportError:
        pass
    for link in exception_chain(exc):
        if isinstance(link, BrokenPipeError):
            return None  # a reader that went away (`slipstream ... | head`), not the network
        if isinstance(link, tuple(kinds)):
            return link
    return None


# errno -> what it means for a path we write, in a user's words.
_OS_CAUSES = {
    errno.ENOTDIR: "a part of the path is a file, not a directory",
    errno.EEXIST: "it already exists as a file, where a directory or a new file is needed",
    errno.EISDIR: "it is a directory, not a file",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "the file system is read-only",
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EFBIG: "the file is too large for this file system or the file-size limit (ulimit -f)",
    errno.ENAMETOOLONG: "the name is too long",
    errno.ENOENT: "no such file or directory",
    errno.EMFILE: "too many open files (ulimit -n)",
    errno.EIO: "an input/output error on the device",
}


def describe_os_error(exc: OSError) -> str:
    """``cannot write PATH: CAUSE`` for any OSError on a file we read or write."""
    cause = _OS_CAUSES.get(exc.errno or -1) or exc.strerror or describe(exc)
    paths = [p for p in (exc.filename, exc.filename2) if p is not None]
    where = " -> ".join(str(p) for p in paths) if paths else "a file of the run"
    return f"cannot use {where}: {cause}"
