"""On a GPU: a one-process DDP run over NCCL, and the fsdp plugin over NCCL, each
train and end with the weights of the same run without them. One GPU cannot hold two
NCCL ranks (NCCL refuses a duplicate GPU), so the process group has one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from cuda_common import CUDA

pytestmark = [*CUDA, pytest.mark.skipif(not dist.is_nccl_available(), reason="this torch has no NCCL")]
HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_process(tmp_path: Path, mode: str) -> dict:
    out = tmp_path / f"{mode}.json"
    path = os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, str(HERE / "nccl_one_process.py"), mode, str(out), str(_free_port())],
        capture_output=True, text=True, timeout=75, env={**os.environ, "PYTHONPATH": path},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text())


def test_ddp_over_nccl_in_one_process_trains(tmp_path):
    seen = _one_process(tmp_path, "ddp")
    assert seen["backend"] == "nccl" and seen["status"] == "completed" and seen["batches"] == 4
    assert seen["allreduce_calls"] >= 4  # every step's gradients went through NCCL
    assert seen["same_keys"] and seen["loss_finite"]
    assert seen["max_abs_diff"] < 1e-5, seen  # a mean over one rank changes nothing


def test_fsdp_over_nccl_in_one_process_trains(tmp_path):
    seen = _one_process(tmp_path, "fsdp")
    assert seen["backend"] == "nccl" and seen["status"] == "completed" and seen["batches"] == 4
    assert seen["sharded"] and seen["fsdp"]["units"] == 5  # layer1-4 and the root
    assert seen["same_keys"] and seen["loss_finite"]
    assert seen["max_abs_diff"] < 1e-4, seen
