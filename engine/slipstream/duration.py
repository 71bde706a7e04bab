"""Durations with a unit: ``10ep``, ``2000ba``, ``50000sp``, ``0.3dur``, ``90s``, ``15m``, ``24h``."""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass

from slipstream.errors import ConfigError

# Wall-clock units are normalised to seconds so that one unit ("s") covers them all.
_WALL_CLOCK = {"s": 1.0, "m": 60.0, "h": 3600.0}
UNITS = ("ep", "ba", "sp", "dur", "s")
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?\s*(ep|ba|sp|dur|s|m|h)\s*$")


class DurationError(ValueError):
    """A duration string could not be parsed."""


@dataclass(frozen=True)
class Duration:
    """An amount of training time. ``unit`` is one of :data:`UNITS`."""

    value: float
    unit: str

    @classmethod
    def parse(cls, text: str | Duration | int | float) -> Duration:
        if isinstance(text, Duration):
            return text
        if isinstance(text, bool) or not isinstance(text, str):
            raise DurationError(
                f"{text!r} is not a duration: write a number with a unit, e.g. "
                "'10ep', '2000ba', '50000sp', '0.3dur', '90s', '15m' or '24h'"
            )
        match = _PATTERN.match(text)
        if match is None:
            raise DurationError(
                f"{text!r} is not a duration: write a number with a unit, one of "
                "ep (epochs), ba (batches), sp (samples), dur (fraction of the run), "
                "s, m, h (wall clock) — e.g. '10ep', '0.3dur', '15m'"
            )
        number, exponent, unit = match.groups()
        try:
            value = float(number) * (10 ** int(exponent) if exponent else 1)
        except OverflowError:
            value = float("inf")
        if value == float("inf"):
            raise DurationError(f"{text!r} is too large a duration to represent")
        if unit in _WALL_CLOCK:
            value, unit = value * _WALL_CLOCK[unit], "s"
        if unit == "dur" and value > 1:
            raise DurationError(f"{text!r}: a 'dur' duration is a fraction of the run, from 0 to 1")
        return cls(value, unit)

    def __str__(self) -> str:
        value = int(self.value) if float(self.value).is_integer() else self.value
        return f"{value}{self.unit}"


def parse_duration_option(
    algorithm: str,
    key: str,
    value: str | Duration,
    *,
    positive: bool = False,
    units: Collection[str] | None = None,
) -> Duration:
    """A duration from a plugin's config key, or a ConfigError naming the algorithm
    and the key: ``value`` must parse, be above zero with ``positive``, and be in
    one of ``units`` when given.

    >>> parse_duration_option("ema", "half_life", "50ba", positive=True)
    Duration(value=50.0, unit='ba')
    >>> parse_duration_option("ema", "half_life", "10m", units=("ba", "ep", "sp", "dur"))
    Traceback (most recent call last):
    ...
    slipstream.errors.ConfigError: algorithms.ema: half_life must be a duration in ba, ep, sp or dur, got '10m'
    """
    try:
        duration = Duration.parse(value)
    except DurationError as exc:
        raise ConfigError(f"algorithms.{algorithm}: {key}: {exc}") from None
    if (positive and duration.value <= 0) or (units is not None and duration.unit not in units):
        names = list(units or ())
        within = f" in {', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else ""
        within = within or (f" in {names[0]}" if names else "")
        kind = "a positive duration" if positive else "a duration"
        raise ConfigError(f"algorithms.{algorithm}: {key} must be {kind}{within}, got {value!r}")
    return duration
