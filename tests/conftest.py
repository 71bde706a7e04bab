import os
import sys
from pathlib import Path

import pytest
import torch

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
