"""Data-parallel training under torchrun (gloo on CPU): two processes, one run."""

import json
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from slipstream import ConfigError, TrainerOptions
from slipstream.config.schema import build_config

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


def _torchrun(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    # A free port may be taken again before torchrun listens on it (by a test on
    # another pytest-xdist worker): then try another port.
    for _ in range(3):
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
             "--master_addr=127.0.0.1", f"--master_port={_free_port()}", *args],
            capture_output=True, text=True, timeout=timeout,
        )
        if result.returncode == 0 or "EADDRINUSE" not in result.stderr:
            return result
    return result


def test_two_processes_train_one_run(tmp_path):
    run_dir = tmp_path / "run"
    result = _torchrun(
        "-m", "slipstream", "train", "--quiet",
        "model.name=test_resnet", "data.train_size=128", "data.val_size=32", "data.image_size=16",
        "data.batch_size=16", "trainer.max_duration=3ba", "trainer.threads=1", "trainer.autotune=false",
        f"trainer.run_dir={run_dir}",
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


# Evaluation under two processes of a model whose class count is found at its first
# evaluation: one set that only rank 0 holds (rank 1 sees no batch, so it learns the
# class count from rank 0), one that a DistributedSampler pads (5 samples on 2 ranks).
EVAL_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    from slipstream import Trainer

    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    x = torch.rand(5, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 0, 1])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(4, 3))  # no num_classes: metrics are built at the first batch
    sampler = DistributedSampler(TensorDataset(x, y), num_replicas=2, rank=rank, shuffle=False)
    padded = DataLoader(TensorDataset(x, y), batch_size=2, sampler=sampler)

    class Lopsided:  # an iterable of unknown length: rank 1's yields nothing
        def __iter__(self):
            return iter([(x, y)] if rank == 0 else [])

    trainer = Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), train_data=[(x, y)],
                      eval_data={"lopsided": Lopsided(), "padded": padded}, max_duration="1ba",
                      metrics=["loss", "accuracy", "f1_macro"], run_dir=os.path.join(out, "run"),
                      checkpoint_interval=None, progress_bar=False, verbose=False)
    trainer.fit()
    model.eval()
    with torch.no_grad():
        logits = model(x)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"metrics": trainer.state.eval_metrics, "logits": logits.tolist(), "targets": y.tolist()}, f)
    """
)


def test_metrics_built_at_the_first_batch_agree_across_ranks_and_count_each_sample_once(tmp_path):
    from torchmetrics.functional.classification import multiclass_f1_score

    script = tmp_path / "eval_script.py"
    script.write_text(EVAL_SCRIPT)
    # Before the fix a metric's check at its construction waited in torchmetrics' sync
    # for a rank that was in another collective: a hang, hence the shorter limit.
    result = _torchrun(str(script), str(tmp_path), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["metrics"] == r1["metrics"]  # every rank reads the same numbers (early stopping, the target)
    logits, targets = torch.tensor(r0["logits"]), torch.tensor(r0["targets"])
    whole = {
        "loss": torch.nn.functional.cross_entropy(logits, targets).item(),
        "accuracy": (logits.argmax(1) == targets).float().mean().item(),
        "f1_macro": multiclass_f1_score(logits, targets, num_classes=3, average="macro").item(),
    }
    for prefix in ("", "padded/"):  # the first set's keys are bare
        for name, value in whole.items():
            assert r0["metrics"][prefix + name] == pytest.approx(value, rel=1e-5, abs=1e-6), prefix + name


TINY_RUN = (
    "--quiet", "model.name=test_resnet", "data.train_size=64", "data.val_size=16",
    "data.image_size=16", "data.batch_size=8", "trainer.max_duration=2ba", "trainer.threads=1",
    "trainer.autotune=false",  # a subprocess: tests/conftest.py cannot fix its variants
)


def _slipstream(*args: str, cwd=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "slipstream", "train", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
    )


def test_two_launchers_as_two_nodes_train_one_fsdp_run(tmp_path):
    # Two "machines" on localhost: node 0 hosts the rendezvous, each starts one process.
    # No trainer.run_dir: each process names one by its clock and rank 0's is used by
    # all, so the shards of both ranks land in the one run directory.
    port = _free_port()
    nodes = [
        _slipstream(
            "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(rank),
            "--master-addr", "127.0.0.1", "--master-port", str(port),
            *TINY_RUN, "--algorithms", "fsdp", "algorithms.fsdp.sharded_checkpoint=true",
            cwd=tmp_path,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1  # one run directory ...
    run_dir = runs[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["samples"] == 2 * 8 * 2
    assert [a["name"] for a in summary["algorithms"]][-1] == "fsdp"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in records if r["kind"] == "eval"]) == 1  # ... written once
    assert len(list(run_dir.glob("checkpoints/ep*-ba2.dcp/*.distcp"))) == 2  # a shard per rank


def test_launcher_refuses_bad_config_before_starting_and_says_it_once(tmp_path):
    # Refused in the launching process: no worker starts, one line, no traceback.
    bad = _slipstream("--nproc-per-node", "2", *TINY_RUN, "algorithms.fsdp.min_params=0")
    out, err = bad.communicate(timeout=120)
    assert bad.returncode == 2
    assert err.count("slipstream: error:") == 1 and "min_params" in err
    assert "Traceback" not in err
    # An error only the workers can find (the data) is still said once, by rank 0.
    missing = _slipstream(
        "--nproc-per-node", "2", *TINY_RUN, "data.name=imagefolder", f"data.root={tmp_path / 'none'}",
        f"trainer.run_dir={tmp_path / 'run'}",
    )
    out, err = missing.communicate(timeout=300)
    assert missing.returncode == 2
    assert err.count("slipstream: error:") == 1 and "does not exist" in err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()


class _HalfUsed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.used(x)


def test_ddp_options_and_the_unused_parameter_message(monkeypatch):
    from types import SimpleNamespace

    import slipstream.services.steps as steps

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}")
    monkeypatch.setattr(steps, "is_distributed", lambda: True)  # DDP's checks run at any world size
    try:
        def two_steps(defaults):
            state = SimpleNamespace(model=_HalfUsed(), batch=(torch.rand(3, 2), None), device=torch.device("cpu"))
            state.model = defaults.wrap_model(state)
            for _ in range(2):
                defaults.forward(state).sum().backward()
            return state.model

        with pytest.raises(ConfigError, match=r"set trainer\.ddp\.find_unused_parameters=true"):
            two_steps(steps.DefaultSteps())
        ddp = two_steps(steps.DefaultSteps({"find_unused_parameters": True, "bucket_cap_mb": 1}))
        assert ddp.find_unused_parameters and ddp.bucket_bytes_cap == 1024 * 1024
    finally:
        dist.destroy_process_group()


def test_ddp_options_are_checked():
    with pytest.raises(ConfigError, match=r"trainer\.ddp\.bucket is not a DDP option; allowed: bucket_cap_mb"):
        TrainerOptions(ddp={"bucket": 3}).validate("trainer.")
    with pytest.raises(ConfigError, match=r"bucket_cap_mb must be a number of megabytes > 0"):
        TrainerOptions(ddp={"bucket_cap_mb": 0}).validate()
    cfg = build_config("default", None, ["trainer.ddp.static_graph=true"])
    ddp = TrainerOptions.from_config(cfg.trainer).validate().ddp
    assert ddp == {"static_graph": True, "find_unused_parameters": False}


# A NaN loss on rank 1 only, at the third batch (finite gradients): both ranks must stop together (or the
# next all-reduce hangs), and rank 0, which saw only finite losses, says where it was.
NAN_ON_ONE_RANK = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from torch import nn
    from slipstream import Algorithm, Trainer, hookimpl

    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)

    class NanOnRank1(Algorithm):
        name = "nan_on_rank1"

        @hookimpl(wrapper=True)
        def compute_loss(self, state):
            loss = yield
            if rank == 1 and state.timestamp.batch == 2:
                # The value only: the gradients stay finite, so rank 0's weights and
                # losses do too, and only the check's all-reduce can stop rank 0.
                loss = loss + loss.detach() * float("nan")
            return loss

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    data = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(10)]
    trainer = Trainer(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), train_data=data,
        max_duration="10ba", algorithms=[NanOnRank1()], run_dir=os.path.join(out, "run"),
        eval_interval=None, checkpoint_interval=None, log_interval=2, progress_bar=False,
        verbose=False,
    )
    summary = trainer.fit()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"batches": trainer.state.timestamp.batch, "status": summary["status"],
                   "nonfinite": summary.get("nonfinite_loss")}, f)
    """
)


def test_a_nan_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    script = tmp_path / "nan_script.py"
    script.write_text(NAN_ON_ONE_RANK)
    result = _torchrun(str(script), str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["status"] == r1["status"] == "diverged"
    assert r0["batches"] == r1["batches"] == 4  # the check at the log interval after step 3
    assert r1["nonfinite"]["first_step"] == 3 and r1["nonfinite"]["first_value"] == "nan"
    assert r0["nonfinite"]["first_step"] == 4  # the interval's last step: rank 0 saw no NaN itself


def test_a_plain_dataloader_under_several_processes_is_named(tmp_path, monkeypatch):
    # Told at construction (rank 0): the check needs no process group, only the world size.
    from helpers import tiny_loaders, tiny_model
    from slipstream import Trainer
    from slipstream.data import EpochSampler, build_loader

    model = tiny_model()
    plain = tiny_loaders()[0]  # a DataLoader with torch's SequentialSampler

    def build(data, world_size):
        monkeypatch.setattr("slipstream.run.process.init_distributed", lambda device: (0, world_size))
        return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, run_dir=tmp_path / "run",
                       progress_bar=False, verbose=False)

    with pytest.warns(UserWarning, match="SequentialSampler, so each of the 2 processes trains on the whole dataset"):
        build(plain, 2)
    import warnings

    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        build(plain, 1)  # one process: nothing to say
        sharded = build_loader(plain.dataset, batch_size=16, seed=0, rank=0, world_size=2)
        assert isinstance(sharded.sampler, EpochSampler)
        build(sharded, 2)
    assert not [w for w in told if "whole dataset" in str(w.message)]


# Rank 1's clock runs 1.5 s ahead of rank 0's from the start, as a slow start or a
# loaded machine can make it: on its own clock it would evaluate and stop batches
# before rank 0, which would then wait for it in DDP's all-reduce for ever.
SKEWED_CLOCKS = textwrap.dedent(
    """
    import json, os, sys, time
    import timm, torch
    from slipstream import Algorithm, Trainer, hookimpl
    from slipstream.data import build_datasets, build_loader

    out = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    train, val, classes = build_datasets("synthetic", image_size=16, train_size=64, val_size=16)
    loader = build_loader(train, batch_size=4, seed=0, rank=rank, world_size=world)
    evals = build_loader(val, batch_size=4, seed=0, rank=rank, world_size=world, shuffle=False)
    torch.manual_seed(0)
    model = timm.create_model("test_resnet", num_classes=classes)

    class Skew(Algorithm):
        name = "skew"
        evaluated_at = []

        @hookimpl
        def fit_start(self, state):
            if rank == 1:
                state._clock_start -= 1.5

        @hookimpl
        def batch_start(self, state):
            time.sleep(0.05)

        @hookimpl
        def eval_start(self, state):
            self.evaluated_at.append(state.timestamp.batch)

    trainer = Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), train_data=loader,
                      eval_data=evals, max_duration="3s", eval_interval="0.25dur", algorithms=[Skew()], log_interval=1,
                      run_dir=os.path.join(out, "run"), checkpoint_interval=None, progress_bar=False, verbose=False)
    trainer.fit()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"batches": trainer.state.timestamp.batch, "evaluated_at": Skew.evaluated_at}, f)
    """
)


def test_ranks_whose_clocks_differ_end_and_evaluate_a_wall_clock_run_together(tmp_path):
    script = tmp_path / "skewed.py"
    script.write_text(SKEWED_CLOCKS)
    try:
        result = _torchrun(str(script), str(tmp_path), timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the ranks of a wall-clock run hung: they decided by their own clocks")
    assert result.returncode == 0, result.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1 and r0["batches"] > 0 and r0["evaluated_at"]
