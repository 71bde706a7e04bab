"""Errors that the CLI reports as one clear message instead of a traceback."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class SlipstreamError(Exception):
    """A user-facing error: bad config, unknown algorithm, corrupt checkpoint, ..."""


class ConfigError(SlipstreamError, ValueError):
    """The configuration, a recipe or an algorithm's options are invalid."""


class PluginError(SlipstreamError):
    """A plugin could not be found, loaded, ordered or combined."""


class CheckpointError(SlipstreamError):
    """A checkpoint could not be read or does not fit the run."""


def closest(word: str, choices: Iterable[str]) -> str | None:
    matches = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return matches[0] if matches else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    match = closest(word, choices)
    return f" (did you mean {match!r}?)" if match else ""
