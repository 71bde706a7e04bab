import os
import sys
from pathlib import Path

import pytest
import torch

from slipstream.services.cpu_kind import ENV as CPU_KIND_ENV

# Tests share small helpers (tiny data, tiny models, a recording probe plugin).
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _deterministic_threads():
    # Two cores: one intra-op thread per test keeps timings stable and fair.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True, scope="session")
def _cache_outside_home(tmp_path_factory):
    # The engine caches the device's peak FLOP/s in the user's cache directory: tests
    # (and the CLI subprocesses they start) use a session-wide one of their own,
    # never the real home, and probe once per session.
    previous = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg_cache"))
    yield
    if previous is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = previous


# The CPU kinds a test that takes the `cpu_kind` fixture runs under, whatever this
# machine is (docs/contributing.md). "other" (not x86-64) asks oneDNN, so is left out.
CPU_KINDS = ("avx2", "avx512", "avx512_bf16", "amx")


@pytest.fixture(params=CPU_KINDS)
def cpu_kind(request, monkeypatch) -> str:
    """Run the test as if on each CPU kind: the engine's detector (slipstream.cpu_kind)
    answers this kind, here and in the CLI subprocesses the test starts."""
    monkeypatch.setenv(CPU_KIND_ENV, request.param)
    return request.param


def pytest_collection_modifyitems(config, items):
    # `-m cpu_kind` selects the kind-dependent tests; everything else runs once.
    for item in items:
        if "cpu_kind" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cpu_kind)


_measuring = {"allowed": False}


@pytest.fixture(autouse=True, scope="session")
def _variants_fixed_unless_marked_autotune():
    """A run in a test measures `auto` variants only where the test is marked
    `autotune`: elsewhere which variant wins would depend on the machine's speed and
    load (and, through the shared cache, on which test measured first). So every other
    in-process run takes each plugin's fallback, as with `trainer.autotune=false`: NHWC
    for channels_last, and for mixed_precision bf16 where the CPU kind has bf16 units,
    fp32 elsewhere. Session-wide, so that runs made by module fixtures are fixed too.
    (A CLI run in a subprocess passes `trainer.autotune=false` itself.)"""
    from slipstream.plugins import variants

    choose = variants.choose_variants

    def fixed(*args, **kwargs):
        if not _measuring["allowed"]:
            kwargs["measure_on"] = False
        return choose(*args, **kwargs)

    variants.choose_variants = fixed
    yield
    variants.choose_variants = choose


@pytest.fixture(autouse=True)
def _measuring_where_marked(request):
    _measuring["allowed"] = request.node.get_closest_marker("autotune") is not None
    yield
    _measuring["allowed"] = False
