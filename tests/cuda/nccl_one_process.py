"""Run by tests/cuda/test_cuda_distributed.py: one process on one GPU joins an NCCL
process group of one, trains 4 batches with DDP (`ddp`) or the fsdp plugin (`fsdp`),
and the same 4 batches without either; writes what it saw to OUT.json.

    python nccl_one_process.py ddp|fsdp OUT.json PORT
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from cuda_common import fit_cuda, small_model, synthetic_loaders
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

mode, out, port = sys.argv[1], sys.argv[2], sys.argv[3]
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
calls = {"allreduce": 0}


def counting_allreduce(state, bucket):
    calls["allreduce"] += 1
    return allreduce_hook(state, bucket)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    full = {}
    for name, value in model.state_dict().items():
        value = value.full_tensor() if isinstance(value, DTensor) else value
        full[name] = value.detach().float().cpu()
    return full


def run(tmp: str, wrap: str | None) -> tuple[dict, dict]:
    model = small_model().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    algorithms = []
    if wrap == "ddp":
        model = DistributedDataParallel(model, device_ids=[0])
        model.register_comm_hook(state=None, hook=counting_allreduce)
    elif wrap == "fsdp":
        from slipstream_fsdp import FSDP

        algorithms = [FSDP()]
    trainer = fit_cuda(
        Path(tmp),
        algorithms,
        model=model,
        optimizer=optimizer,
        loaders=synthetic_loaders(n=128, batch_size=32),
        max_duration="4ba",
        deterministic=True,
    )
    model = trainer.state.unwrapped_model
    summary = {**trainer.summary, "sharded": any(isinstance(p, DTensor) for p in model.parameters())}
    return summary, weights(model)


summary, wrapped = run(out + ".wrapped", mode)
_, plain = run(out + ".plain", None)
worst = max((wrapped[k] - plain[k]).abs().max().item() for k in plain)
result = {
    "backend": dist.get_backend(),
    "status": summary["status"],
    "batches": summary["batches"],
    "world_size": summary["world_size"],
    "allreduce_calls": calls["allreduce"],
    "fsdp": summary.get("fsdp"),
    "sharded": summary["sharded"],
    "same_keys": sorted(wrapped) == sorted(plain),
    "max_abs_diff": worst,
    "loss_finite": all(v.isfinite().all().item() for v in wrapped.values()),
}
with open(out, "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
