"""Run by tests/algorithms/test_fsdp.py under torchrun (2 gloo processes, 1 thread each).

OUT/full: fsdp, 6 batches, full checkpoints every 3 batches (the third is mid-epoch).
OUT/full_resumed: resumed from full's ep0-ba3.pt, to 6 batches.
OUT/sharded, OUT/sharded_resumed: the same with sharded_checkpoint.
OUT/ema, OUT/ema_resumed: fsdp with ema (a sharded average), straight and resumed.
OUT/accumulated: fsdp with grad_accumulation (2 batches per step) and grad_clipping.
OUT/default_optimizer: fsdp with the CLI's default optimizer (SGD, impl auto: fused).
OUT/refused.json: what an explicit impl=fused under fsdp raised, and whether its run
directory was created.
Each run's final full weights go to OUT/<run>.weights.pt (rank 0 writes), and the
number of gradient reduce-scatters each run made to OUT/reductions.json.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from slipstream_ema import EMA, EMAConfig
from slipstream_fsdp import FSDP, FSDPConfig
from slipstream_grad_accumulation import GradAccumulation, GradAccumulationConfig
from slipstream_grad_clipping import GradClipping, GradClippingConfig
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from helpers import tiny_model
from slipstream import ConfigError, Trainer
from slipstream.data import build_datasets, build_loader
from slipstream.optim import build_optimizer

out = sys.argv[1]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.set_num_threads(1)
train, val, classes = build_datasets("synthetic", image_size=16, train_size=64, val_size=16, num_classes=4)


reductions: dict[str, int] = {}
_reduce_scatter = dist.reduce_scatter_single  # what FSDP2 reduces gradients with


def counting_reduce_scatter(*args, **kwargs):
    reductions[current] = reductions.get(current, 0) + 1
    return _reduce_scatter(*args, **kwargs)


dist.reduce_scatter_single = counting_reduce_scatter
current = ""


def run(name: str, algorithms: list, load: str | None = None, batches: int = 6, impl: str | None = None) -> None:
    global current
    current = name
    loader = build_loader(train, batch_size=8, seed=0, rank=rank, world_size=world)
    model = tiny_model("vit", num_classes=classes)  # seeded: the same weights on every rank
    optimizer = (
        torch.optim.AdamW(model.parameters(), lr=1e-3)
        if impl is None
        else build_optimizer(model, "sgd", 0.05, impl=impl)  # the CLI's default optimizer
    )
    trainer = Trainer(
        model=model,
        optimizer=optimizer,
        train_data=loader,
        # Evaluated each epoch and at the end: a forward without backward leaves the root
        # gathered, and checkpoints come after it.
        eval_data=build_loader(val, batch_size=8, shuffle=False, drop_last=False, rank=rank, world_size=world),
        max_duration=f"{batches}ba",
        algorithms=algorithms,
        run_dir=os.path.join(out, name),
        checkpoint_interval="3ba",
        load_path=os.path.join(out, load, "checkpoints", "ep0-ba3.pt") if load else None,
        log_interval=1,  # every record reads the (sharded) gradient norm
        progress_bar=False,
        verbose=False,
        device="cpu",
    )
    trainer.fit()
    full = get_model_state_dict(
        trainer.state.unwrapped_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        torch.save(full, os.path.join(out, f"{name}.weights.pt"))


def fsdp(**options) -> FSDP:
    return FSDP(FSDPConfig(**options))


run("full", [fsdp()])
run("full_resumed", [fsdp()], load="full")
run("sharded", [fsdp(sharded_checkpoint=True, reshard_after_forward=False)])
run("sharded_resumed", [fsdp(sharded_checkpoint=True, reshard_after_forward=False)], load="sharded")
run("ema", [fsdp(), EMA(EMAConfig(decay=0.8))])
run("ema_resumed", [fsdp(), EMA(EMAConfig(decay=0.8))], load="ema")
accumulate = GradAccumulation(GradAccumulationConfig(steps=2))
run("accumulated", [fsdp(), accumulate, GradClipping(GradClippingConfig(max_norm=0.05))], batches=4)
run("default_optimizer", [fsdp()], batches=3, impl="auto")
try:
    run("refused", [fsdp()], batches=3, impl="fused")
    refused = {"error": None}
except ConfigError as exc:
    refused = {"error": str(exc), "run_dir": os.path.exists(os.path.join(out, "refused"))}
if rank == 0:
    with open(os.path.join(out, "reductions.json"), "w") as f:
        json.dump(reductions, f)
    with open(os.path.join(out, "refused.json"), "w") as f:
        json.dump(refused, f)
