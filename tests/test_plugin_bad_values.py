"""Every option of every installed plugin is checked before anything is written.

The plugins are discovered, not listed: each option gets values that are not
finite, out of its declared range, not one of its names, or of the wrong type, on
the command line (the in-process ``main``), and each must end in one line naming
the plugin and the key, exit 2, and no run directory. A numeric option must declare
its rule with :func:`slipstream.plugin_option` (else this test cannot know what is
out of range, and neither can a user)."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from helpers import TINY_RUN, error_lines
from slipstream import ConfigError, check_value, plugin_option
from slipstream.cli.main import main
from slipstream.plugins.checks import check_plugin_options, option_rule
from slipstream.plugins.discovery import ALGORITHMS_GROUP, CALLBACKS_GROUP, GROUPS, discover

TINY = [*TINY_RUN, "trainer.max_duration=1ba", "trainer.checkpoint_interval=null"]


def _yaml(value: float) -> str:
    if math.isnan(value):
        return ".nan"
    if math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    return repr(value)


def _bad_values(field: dataclasses.Field, hints: dict[str, typing.Any]) -> list[str]:
    """Override values (as typed after ``key=``) that ``field`` must refuse."""
    rule = option_rule(field)
    tp = hints[field.name]
    args = set(typing.get_args(tp)) - {type(None)}
    base = next(iter(args)) if len(args) == 1 else tp
    if rule is None:
        assert base not in (int, float), (
            f"{field.name} is a number without a rule: declare it with slipstream.plugin_option"
        )
        if base is bool:
            return ["maybe"]
        if base is str:
            return ["[1, 2]"]  # the wrong type
        return ["{a: 1}" if typing.get_origin(base) is list else "5"]
    if rule.choices is not None:
        return ["no_such_name", "[1, 2]"]
    bad: list[float] = [math.nan]
    if rule.finite:
        bad.append(math.inf)
    if rule.low is not None:
        bad.append(rule.low if rule.low_open else rule.low - 1)
    if rule.high is not None:
        bad.append(rule.high if rule.high_open else rule.high + 1)
    if rule.whole:
        bad.append(1.5)
    values = [_yaml(v) for v in bad] + ["abc"]
    if rule.items:  # a list option: the bad number inside a list
        return [f"[{v}, {v}]" for v in values[:-1]] + ["abc"]
    return values


def _cases() -> list[tuple[str, str, str, str]]:
    cases = []
    for group in (ALGORITHMS_GROUP, CALLBACKS_GROUP):
        kind = GROUPS[group][1]
        for name, info in discover(group=group).items():
            assert info.cls is not None, f"{name} failed to load: {info.error}"
            config = info.cls.config_class
            if config is None:
                continue
            hints = typing.get_type_hints(config)
            for field in dataclasses.fields(config):
                for value in _bad_values(field, hints):
                    cases.append((kind, name, field.name, value))
    return cases


CASES = _cases()


def test_every_plugin_with_options_is_covered():
    covered = {(kind, name) for kind, name, _, _ in CASES}
    for group in (ALGORITHMS_GROUP, CALLBACKS_GROUP):
        for name, info in discover(group=group).items():
            if info.cls.config_class is not None:
                assert (GROUPS[group][1], name) in covered


def test_every_bad_option_value_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, monkeypatch):
    # Each option's first bad value goes through `slipstream train` (the in-process main):
    # one line naming the plugin and the key, exit 2, no run directory. Every bad value
    # goes through the plugin's config as the command line hands it over (YAML-typed):
    # a ConfigError naming the plugin and the key. (All 370 through main took 22 s.)
    import yaml

    from slipstream.plugins import discovery
    from slipstream.plugins.discovery import plugin_config

    # Each `train` reads the installed entry points, as a user's command does once: read
    # here once for all the commands (they were 44 % of each one's time).
    found: dict = {}
    read = discovery._entry_points
    monkeypatch.setattr(discovery, "_entry_points", lambda group, base: found.get((group, base))
                        or found.setdefault((group, base), read(group, base)))  # fmt: skip
    classes = {(GROUPS[g][1], name): info.cls for g in (ALGORITHMS_GROUP, CALLBACKS_GROUP)
               for name, info in discover(group=g).items()}  # fmt: skip
    failures, through_main = [], set()
    for i, (kind, name, key, value) in enumerate(CASES):
        try:
            plugin_config(classes[kind, name], {key: yaml.safe_load(value)})
            failures.append(f"{kind}s.{name}.{key}={value}: accepted by its config")
        except ConfigError as exc:
            if not (str(exc).startswith(f"{kind}s.{name}") and key in str(exc)):
                failures.append(f"{kind}s.{name}.{key}={value}: {exc}")
        if (kind, name, key) in through_main:
            continue
        through_main.add((kind, name, key))
        run_dir = tmp_path / f"run{i}"
        code = main(
            ["train", "--quiet", f"--{kind}s", name, *TINY]
            + [f"{kind}s.{name}.{key}={value}", f"trainer.run_dir={run_dir}"]
        )
        out, err = capsys.readouterr()
        lines = error_lines(err)
        ok = (
            code == 2
            and len(lines) == 1
            and lines[0].startswith(f"slipstream: error: {kind}s.{name}")
            and key in lines[0]
            and not run_dir.exists()
        )
        if not ok:
            failures.append(f"{kind}s.{name}.{key}={value}: exit {code}, {err.strip()!r}, run dir {run_dir.exists()}")
    assert not failures, "\n".join(failures)


@dataclasses.dataclass
class _Example:
    rate: float = plugin_option(0.5, low=0, high=1, high_open=True)
    steps: int = plugin_option(1, low=1, whole=True)
    names: list = plugin_option(default_factory=lambda: ["a"], choices=("a", "b"), items=True)

    def __post_init__(self) -> None:
        check_plugin_options(self)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate": math.nan}, r"^rate must be a finite number in \[0, 1\), got nan$"),
        ({"rate": 1.0}, r"^rate must be a finite number in \[0, 1\), got 1.0$"),
        ({"rate": "0.5"}, r"^rate must be a finite number in \[0, 1\), got '0.5'$"),
        ({"steps": True}, r"^steps must be a whole number >= 1, got True$"),
        ({"steps": 2.0}, r"^steps must be a whole number >= 1, got 2.0$"),
        ({"names": ["a", "c"]}, r"^names must be a list of values, each one of a, b, got \['a', 'c'\]$"),
        ({"names": "a"}, r"^names must be a list of values, each one of a, b, got 'a'$"),
    ],
)
def test_a_rule_refuses_from_python_too(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _Example(**kwargs)


def test_check_value_is_the_same_rule_for_a_functional_api():
    assert check_value("p", 0.0, low=0, high=1) == 0.0
    with pytest.raises(ValueError, match=r"^p must be a finite number in \[0, 1\], got inf$"):
        check_value("p", math.inf, low=0, high=1)
