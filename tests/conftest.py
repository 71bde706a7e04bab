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
