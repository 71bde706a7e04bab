"""Data-parallel training under torchrun (gloo on CPU): two processes, one run."""

import json
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_one_run(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
         f"--master_port={_free_port()}", "-m", "slipstream", "train", "--quiet",
         "model.name=test_resnet", "data.train_size=128", "data.val_size=32", "data.image_size=16",
         "data.batch_size=16", "trainer.max_duration=3ba", "trainer.threads=1", f"trainer.run_dir={run_dir}"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["samples"] == 3 * 16 * 2  # a global batch is the per-process batch times the world size
    assert summary["accuracy"] is not None
    assert (run_dir / "checkpoints" / "latest.pt").exists()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in records if r["kind"] == "eval"]) == 1  # only rank 0 writes
