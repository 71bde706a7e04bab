"""The plugin host: discovery, config validation, ordering, conflicts."""

import dataclasses
import importlib
from pathlib import Path

import pytest

from helpers import fake_distribution
from slipstream import Algorithm, ConfigError, PluginError
from slipstream.plugins.discovery import discover, instantiate, plugin_config, resolve_order

GOOD = '''
from dataclasses import dataclass
from slipstream import Algorithm, hookimpl

@dataclass
class ShoutConfig:
    volume: int = 3
    word: str = "hey"
    def __post_init__(self):
        if not 0 <= self.volume <= 10:
            raise ValueError(f"volume must be between 0 and 10, got {self.volume}")

class Shout(Algorithm):
    """Shouts at every batch."""
    name = "shout"
    config_class = ShoutConfig
'''

BROKEN = "import a_module_that_does_not_exist_anywhere\n"


@pytest.fixture
def site(tmp_path, monkeypatch):
    site = tmp_path / "site"
    fake_distribution(site, "slipstream-shout", {"shout": "shout_mod:Shout"}, {"shout_mod": GOOD})
    fake_distribution(
        site, "slipstream-broken", {"broken": "broken_mod:Broken"}, {"broken_mod": BROKEN}
    )
    monkeypatch.syspath_prepend(str(site))
    return site


def test_discovery_lists_installed_plugins_and_marks_failures(site):
    found = discover()
    assert found["shout"].cls is not None and found["shout"].cls.name == "shout"
    assert found["shout"].distribution == "slipstream-shout"
    assert found["shout"].version == "0.1.0"
    assert found["shout"].summary == "Shouts at every batch."
    assert found["broken"].cls is None
    assert "ModuleNotFoundError" in found["broken"].error


def test_a_plugin_that_fails_to_import_is_an_error_naming_distribution_and_entry_point(site):
    with pytest.raises(PluginError) as err:
        instantiate({"broken": None}, discover())
    message = str(err.value)
    assert "slipstream-broken" in message and "broken_mod:Broken" in message
    assert "a_module_that_does_not_exist_anywhere" in message


def test_unknown_algorithm_lists_installed_and_closest(site):
    with pytest.raises(PluginError) as err:
        instantiate({"shoot": None}, discover())
    message = str(err.value)
    assert "unknown algorithm 'shoot'" in message
    assert "did you mean 'shout'" in message
    assert "installed algorithms:" in message and "shout" in message


def test_config_is_validated_before_the_run(site):
    cls = discover()["shout"].cls
    assert plugin_config(cls, {"volume": 5}).volume == 5
    with pytest.raises(
        ConfigError,
        match=r"algorithms.shout: unknown key 'volum' \(did you mean 'volume'\?\); allowed keys: volume, word",
    ):
        plugin_config(cls, {"volum": 5})
    with pytest.raises(ConfigError, match=r"algorithms.shout.volume.*int"):
        plugin_config(cls, {"volume": "loud"})
    with pytest.raises(
        ConfigError, match=r"algorithms.shout: volume must be between 0 and 10, got 11"
    ):
        plugin_config(cls, {"volume": 11})


def test_an_algorithm_without_config_rejects_options():
    class Plain(Algorithm):
        name = "plain"

    with pytest.raises(ConfigError, match="algorithms.plain takes no options"):
        plugin_config(Plain, {"x": 1})


def _algo(name, after=(), before=(), conflicts=()):
    cls = type(
        name,
        (Algorithm,),
        {"name": name, "runs_after": after, "runs_before": before, "conflicts_with": conflicts},
    )
    return cls()


def names(algos):
    return [a.name for a in algos]


def test_order_honours_declared_constraints_and_otherwise_keeps_the_given_order():
    a, b, c = _algo("a", after=("c",)), _algo("b"), _algo("c")
    assert names(resolve_order([a, b, c])) == ["b", "c", "a"]
    d = _algo("d", before=("b",))
    assert names(resolve_order([b, d])) == ["d", "b"]


def test_constraints_naming_absent_algorithms_are_ignored():
    a = _algo("a", after=("nope",), before=("nothing",), conflicts=("gone",))
    assert names(resolve_order([a])) == ["a"]


def test_a_cycle_is_refused_naming_it():
    a, b = _algo("a", after=("b",)), _algo("b", after=("a",))
    with pytest.raises(
        PluginError,
        match=r"cycle: (a must run after b must run after a|b must run after a must run after b)",
    ):
        resolve_order([a, b])


def test_a_conflict_is_refused_naming_both():
    a, b = _algo("a", conflicts=("b",)), _algo("b")
    with pytest.raises(PluginError, match="'a' conflicts with 'b'"):
        resolve_order([a, b])


def test_the_same_algorithm_twice_is_refused():
    with pytest.raises(PluginError, match="enabled twice"):
        resolve_order([_algo("a"), _algo("a")])


def test_config_dataclasses_of_builtin_algorithms_are_omegaconf_compatible():
    from omegaconf import OmegaConf

    for info in discover().values():
        if info.cls is not None and info.cls.config_class is not None:
            assert dataclasses.is_dataclass(info.cls.config_class), info.name
            OmegaConf.structured(info.cls.config_class)  # raises on unsupported field types


def test_the_listing_reads_metadata_and_imports_no_plugin(site, tmp_path):
    import subprocess
    import sys

    from helpers import fake_distribution
    from slipstream.plugins.discovery import list_installed

    fake_distribution(site, "slipstream-gone", {"gone": "gone_mod:Gone"}, {})  # no module at all
    fake_distribution(
        site, "slipstream-loud", {"loud": "loud_mod:Loud"}, {"loud_mod": "raise RuntimeError('imported')\n"}
    )
    listed = {info.name: info for info in list_installed()}
    assert "loud_mod" not in sys.modules
    assert listed["loud"].error is None  # not imported, so not known to fail
    assert listed["gone"].error == "ModuleNotFoundError: No module named 'gone_mod'"  # found cheaply
    assert listed["channels_last"].summary.startswith("Slipstream plugin: channels-last")  # metadata
    checked = {info.name: info for info in list_installed(check=True)}
    assert checked["loud"].error == "RuntimeError: imported"
    # The command imports neither torch nor any model or augmentation library.
    code = (
        "import sys; from slipstream.cli.main import main; main(['algorithms']); "
        "print(sorted(m for m in ('torch', 'timm', 'torchvision', 'kornia') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[-1] == "[]"


# The algorithms this repository ships, one folder each under algorithms/.
SHIPPED = sorted(p.parent.name for p in (Path(__file__).parents[1] / "algorithms").glob("*/pyproject.toml"))


@pytest.mark.parametrize("name", SHIPPED)
def test_each_shipped_algorithm_is_found_and_loads_through_its_entry_point(name):
    info = discover(load=False)[name]  # import this plugin only, not every installed one
    info.load()
    assert info.error is None
    assert info.distribution == f"slipstream-{name}"
    module = importlib.import_module(f"slipstream_{name}")
    assert info.target == f"slipstream_{name}:{info.cls.__name__}"
    assert info.cls is getattr(module, info.cls.__name__) and info.cls.name == name
