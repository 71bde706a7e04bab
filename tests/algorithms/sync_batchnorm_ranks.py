"""The two-process runs of tests/algorithms/test_sync_batchnorm.py (1 thread each).

- :func:`forked_cpu_rank`: one of two CPU processes forked by the test
  (``torch.multiprocessing``, ``fork``: the ranks inherit the test's imported torch,
  about 1 s in all, where two fresh interpreters under torchrun import torch and dynamo
  again for 15 s of CPU). The engine joins a gloo group from the environment torchrun
  would set; sync_batchnorm is refused at init: OUT/rank<R>.json holds the error,
  whether the run directory was made, and what torch's own SyncBatchNorm says of a CPU
  tensor in that group.
- ``torchrun --nproc_per_node=2 sync_batchnorm_ranks.py OUT``: both ranks on cuda:0 in
  a gloo group of their own (NCCL refuses two ranks on one GPU; CUDA cannot be forked),
  2 batches with and without sync_batchnorm: OUT/rank<R>.pt holds the running means and
  the batch-norm classes of each run.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from slipstream_sync_batchnorm import SyncBatchNorm
from torch import nn
from torch.utils.data import TensorDataset

from slipstream import ConfigError, Trainer
from slipstream.data import build_loader


def tiny_cnn() -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))


def run(out: str, name: str, algorithms: list, device: str) -> Trainer:
    """2 batches of 8 per rank; samples grow brighter with their index, so each rank's
    shard has statistics of its own."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    data = torch.rand(32, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    train = TensorDataset(data * (1 + torch.arange(32.0)[:, None, None, None] / 8), torch.arange(32) % 2)
    model = tiny_cnn()
    trainer = Trainer(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        train_data=build_loader(train, batch_size=8, seed=0, rank=rank, world_size=world),
        max_duration="2ba",
        algorithms=algorithms,
        run_dir=os.path.join(out, name),
        eval_interval=None,
        checkpoint_interval=None,
        progress_bar=False,
        verbose=False,
        device=device,
    )
    trainer.fit()
    return trainer


def forked_cpu_rank(rank: int, out: str, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        run(out, "refused", [SyncBatchNorm()], "cpu")
        result: dict = {"error": None}
    except ConfigError as exc:
        result = {"error": str(exc), "run_dir": os.path.exists(os.path.join(out, "refused"))}
    # What the refusal spares the user: torch's SyncBatchNorm on a CPU tensor in this group of 2.
    try:
        nn.SyncBatchNorm(3).train()(torch.rand(4, 3, 2, 2))
        result["torch"] = None
    except ValueError as exc:
        result["torch"] = str(exc)
    result["world_size"] = dist.get_world_size() if dist.is_initialized() else 1
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def gpu_ranks(out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # the engine joins the group it finds
    found = {}
    for name, algorithms in (("synced", [SyncBatchNorm()]), ("plain", [])):
        trainer = run(out, name, algorithms, "cuda:0")
        model = trainer.state.unwrapped_model
        found[name] = {
            "running_mean": {k: v.cpu() for k, v in model.state_dict().items() if k.endswith("running_mean")},
            "classes": sorted({type(m).__name__ for m in model.modules() if "BatchNorm" in type(m).__name__}),
            "synchronised": (trainer.summary.get("sync_batchnorm") or {}).get("synchronised"),
        }
    torch.save(found, os.path.join(out, f"rank{os.environ['RANK']}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    gpu_ranks(sys.argv[1])
