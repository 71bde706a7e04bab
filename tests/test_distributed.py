"""Data-parallel training under torchrun (gloo on CPU): two processes, one run."""

import json
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")

# Run under torchrun by the test: trains through the Python API with a probe that
# records, per rank, a fingerprint of every image it trained on and the final weights.
RANK_SCRIPT = textwrap.dedent(
    """
    import hashlib, os, sys
    import timm, torch
    from slipstream import Algorithm, Trainer, hookimpl
    from slipstream.data import build_datasets, build_loader

    out = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    train, _, classes = build_datasets("synthetic", image_size=16, train_size=64, val_size=16)
    loader = build_loader(train, batch_size=8, seed=0, rank=rank, world_size=world)
    torch.manual_seed(0)  # the same initial weights on every rank, as DDP expects
    model = timm.create_model("test_resnet", num_classes=classes)
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}

    class Fingerprints(Algorithm):
        name = "fingerprints"
        seen = []

        @hookimpl(tryfirst=True)
        def batch_start(self, state):
            for image in state.batch[0].cpu():
                self.seen.append(hashlib.sha1(image.numpy().tobytes()).hexdigest())

    Trainer(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        train_data=loader,
        max_duration="4ba",
        algorithms=[Fingerprints()],
        run_dir=os.path.join(out, "run"),
        eval_interval=None,
        checkpoint_interval=None,
        progress_bar=False,
        verbose=False,
    ).fit()
    torch.save(
        {
            "seen": Fingerprints.seen,
            "initial": initial,
            "final": {k: v.detach() for k, v in model.named_parameters()},
        },
        os.path.join(out, f"rank{rank}.pt"),
    )
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    # A free port may be taken again before torchrun listens on it (by a test on
    # another pytest-xdist worker): then try another port.
    for _ in range(3):
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
             "--master_addr=127.0.0.1", f"--master_port={_free_port()}", *args],
            capture_output=True, text=True, timeout=300,
        )
        if result.returncode == 0 or "EADDRINUSE" not in result.stderr:
            return result
    return result


def test_two_processes_train_one_run(tmp_path):
    run_dir = tmp_path / "run"
    result = _torchrun(
        "-m", "slipstream", "train", "--quiet",
        "model.name=test_resnet", "data.train_size=128", "data.val_size=32", "data.image_size=16",
        "data.batch_size=16", "trainer.max_duration=3ba", "trainer.threads=1", f"trainer.run_dir={run_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["samples"] == 3 * 16 * 2  # a global batch is the per-process batch times the world size
    assert summary["accuracy"] is not None
    assert (run_dir / "checkpoints" / "latest.pt").exists()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in records if r["kind"] == "eval"]) == 1  # only rank 0 writes


def test_ranks_see_different_data_and_end_with_equal_weights(tmp_path):
    script = tmp_path / "rank_script.py"
    script.write_text(RANK_SCRIPT)
    result = _torchrun(str(script), str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert len(r0["seen"]) == len(r1["seen"]) == 4 * 8
    assert not set(r0["seen"]) & set(r1["seen"])  # each rank trained on its own shard
    for name, weight in r0["final"].items():
        # DDP averaged the gradients, so the parameters stayed identical (batch-norm
        # running statistics are per rank by design, hence parameters only) ...
        assert torch.equal(weight, r1["final"][name]), name
    # ... and they did train.
    assert any(not torch.equal(r0["initial"][k], r0["final"][k]) for k in r0["final"])
