"""One way for plugins to check their options: a rule declared with the config field.

A plugin config is a dataclass; a field made with :func:`plugin_option` carries its
rule (range, finite, whole number, one of ...), and :func:`check_plugin_options`,
called first in the config's ``__post_init__``, applies every rule. Each rule is
written once, next to its default, and a config built in Python is checked the same
as one built from YAML or the command line. A functional API that takes the same
value outside a config calls :func:`check_value` with the same rule.

>>> from dataclasses import dataclass
>>> @dataclass
... class SmoothConfig:
...     smoothing: float = plugin_option(0.1, low=0, high=1, high_open=True)
...     def __post_init__(self) -> None:
...         check_plugin_options(self)
>>> SmoothConfig(smoothing=float("nan"))
Traceback (most recent call last):
...
ValueError: smoothing must be a finite number in [0, 1), got nan
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_RULE = "slipstream_rule"


@dataclass(frozen=True)
class Rule:
    """What an option allows. ``low``/``high`` are inclusive unless ``*_open``;
    ``choices`` makes it a name; ``whole`` a whole number; ``finite=False`` lets
    ``inf`` through (``nan`` never is). ``items`` applies the rule to every element
    of a list. ``note`` is said after the rule (``"0 = torch's default"``)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    whole: bool = False
    finite: bool = True
    choices: tuple[Any, ...] | None = None
    items: bool = False
    note: str = ""

    def allowed(self) -> str:
        """The rule in words, as an error says it."""
        if self.choices is not None:
            text = "one of " + ", ".join(str(c) for c in self.choices)
        else:
            text = "a whole number" if self.whole else ("a finite number" if self.finite else "a number")
            if self.low is not None and self.high is not None:
                text += (
                    f" in {'(' if self.low_open else '['}{_num(self.low)}, "
                    f"{_num(self.high)}{')' if self.high_open else ']'}"
                )
            elif self.low is not None:
                text += f" {'>' if self.low_open else '>='} {_num(self.low)}"
            elif self.high is not None:
                text += f" {'<' if self.high_open else '<='} {_num(self.high)}"
        if self.items:
            text = f"a list of values, each {text}"
        return f"{text} ({self.note})" if self.note else text

    def check(self, key: str, value: Any) -> None:
        """Raise ``ValueError("KEY must be ..., got VALUE")`` unless ``value`` obeys."""
        if value is None:
            return  # a null is the field's type's business (Optional or not)
        if self.items:
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                raise ValueError(f"{key} must be {self.allowed()}, got {value!r}")
            values = list(value)
        else:
            values = [value]
        for item in values:
            if not self._ok(item):
                raise ValueError(f"{key} must be {self.allowed()}, got {_show(value)}")

    def _ok(self, value: Any) -> bool:
        if self.choices is not None:
            return isinstance(value, (str, int, float, bool)) and value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.whole and not isinstance(value, int):
            return False
        if math.isnan(value) or (self.finite and math.isinf(value)):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)


def plugin_option(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Any = dataclasses.MISSING,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    whole: bool = False,
    finite: bool = True,
    choices: Sequence[Any] | None = None,
    items: bool = False,
    note: str = "",
) -> Any:
    """A dataclass field with its :class:`Rule`: ``plugin_option(0.5, low=0, high=1)``
    is a finite number in [0, 1] defaulting to 0.5. :func:`check_plugin_options`
    applies it."""
    rule = Rule(
        low=low,
        high=high,
        low_open=low_open,
        high_open=high_open,
        whole=whole,
        finite=finite,
        choices=tuple(choices) if choices is not None else None,
        items=items,
        note=note,
    )
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_RULE: rule})


def option_rule(field: dataclasses.Field) -> Rule | None:
    """The rule a :func:`plugin_option` field carries, or None."""
    return field.metadata.get(_RULE)


def check_plugin_options(config: Any) -> None:
    """Apply the rule of every :func:`plugin_option` field of the dataclass
    ``config``: a ``ValueError`` naming the first bad key, what it allows and the
    value. The engine adds the plugin's name (``algorithms.ema: decay must be ...``)."""
    for field in dataclasses.fields(config):
        rule = option_rule(field)
        if rule is not None:
            rule.check(field.name, getattr(config, field.name))


def check_value(key: str, value: Any, **rule: Any) -> Any:
    """``value`` if it obeys the rule given as :func:`plugin_option`'s keywords,
    else a ``ValueError``: for a functional API that takes an option outside its
    config. Returns ``value``."""
    Rule(**{k: (tuple(v) if k == "choices" else v) for k, v in rule.items()}).check(key, value)
    return value


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)
