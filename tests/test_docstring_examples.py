"""The examples in docstrings are run as tests, so the documentation cannot drift
from the code it describes."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import slipstream
from slipstream.plugins.discovery import ALGORITHMS_GROUP, CALLBACKS_GROUP, discover


def _engine_modules() -> list[str]:
    return [
        info.name
        for info in pkgutil.walk_packages(slipstream.__path__, prefix="slipstream.")
        if info.name != "slipstream.__main__"
    ]


def _plugin_modules() -> list[str]:
    # Entry points name "module:Class"; the module is what holds the functional API.
    return sorted(
        {
            info.target.split(":")[0]
            for group in (ALGORITHMS_GROUP, CALLBACKS_GROUP)
            for info in discover(load=False, group=group).values()
        }
    )


MODULES = _engine_modules() + _plugin_modules()


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples_pass(module_name: str) -> None:
    module = importlib.import_module(module_name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {module_name}"


def test_the_examples_are_found() -> None:
    # Guards the collection above: if discovery broke, every parametrised test would
    # pass on zero examples.
    attempted = sum(
        doctest.testmod(importlib.import_module(name), report=False).attempted
        for name in MODULES
    )
    assert attempted >= 10
