"""Scaling: strong (fixed global batch) and weak (fixed per-process batch) scaling
from 1 to 2 processes, DDP and FSDP, for the CIFAR-stem ResNet-18 and a small ViT.

Processes x threads = cores: one process uses every core, two use half each, so the
comparison is the same machine cut two ways. Each process count is one launch through
torch.distributed's elastic agent (gloo on CPU); inside it the variants run one after
the other through the real Trainer. Reported per variant: samples/s, scaling
efficiency (throughput over N x the one-process throughput at the same per-process
work), per-process peak RSS growth, and the bytes of parameters + optimizer state
each process holds (counted from the tensors: FSDP keeps about 1/N of them).

    .venv/bin/python benchmarks/bench_scaling.py            # CIFAR size (32 px), 2 repeats
    .venv/bin/python benchmarks/bench_scaling.py --quick    # 2 steps, smaller batches, one repeat
"""

from __future__ import annotations

import os
import statistics
import tempfile
import uuid
from pathlib import Path
from typing import Any

import timm
import torch
from slipstream_fsdp import FSDP
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.distributed.tensor import DTensor

from common import PeakRSS, StepClock, parser, per_step, random_loader
from slipstream import Algorithm, Trainer, hookimpl
from slipstream.models import build_model

MODELS = ("resnet18_cifar", "vit_tiny")


def make_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "resnet18_cifar":
        return build_model("resnet18", 10, image_size=32, cifar_stem=True)
    # ViT-Ti/4 at 32 px: 64 tokens, 5.4M parameters.
    return timm.create_model("vit_tiny_patch16_224", num_classes=10, img_size=32, patch_size=4)


class StateBytes(Algorithm):
    """Bytes of parameters and optimizer state this process holds, at the end of the run."""

    name = "bench_state_bytes"

    def __init__(self) -> None:
        super().__init__()
        self.params = self.optimizer = 0

    @staticmethod
    def _bytes(tensors: Any) -> int:
        local = (t.to_local() if isinstance(t, DTensor) else t for t in tensors)
        return sum(t.numel() * t.element_size() for t in local)

    @hookimpl
    def fit_end(self, state: Any) -> None:
        self.params = self._bytes(state.unwrapped_model.parameters())
        states = state.optimizer.state.values()
        self.optimizer = self._bytes(v for s in states for v in s.values() if torch.is_tensor(v) and v.dim())


def run_variant(model_name: str, parallel: str, batch: int, steps: int, warmup: int) -> dict[str, Any]:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    model = make_model(model_name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = random_loader(batch * (steps + warmup), 32, batch)  # each rank its own batches
    clock, held = StepClock(), StateBytes()
    algorithms: list[Algorithm] = [clock, held]
    if parallel == "fsdp" and world > 1:
        algorithms.insert(0, FSDP())
    with tempfile.TemporaryDirectory() as tmp, PeakRSS() as rss:
        Trainer(
            model=model,
            optimizer=optimizer,
            train_data=loader,
            max_duration=f"{warmup + steps}ba",
            algorithms=algorithms,
            run_dir=Path(tmp) / "run",
            device="cpu",
            eval_interval=None,
            checkpoint_interval=None,
            progress_bar=False,
            verbose=False,
            log_interval=10**9,
        ).fit()
    step_s = per_step(clock.times, warmup)
    return {
        "rank": rank,
        "samples_per_s": batch * world / step_s,
        "peak_rss_mib": rss.peak_mib,
        "state_mib": (held.params + held.optimizer) / 2**20,
    }


def worker(variants: list[tuple[str, str, str, int]], threads: int, steps: int, warmup: int) -> list[dict[str, Any]]:
    torch.set_num_threads(threads)
    results = []
    for model_name, mode, parallel, batch in variants:
        out = run_variant(model_name, parallel, batch, steps, warmup)
        results.append({"model": model_name, "mode": mode, "parallel": parallel, "batch": batch, **out})
    return results


def launch(nproc: int, variants: list[tuple[str, str, str, int]], threads: int, steps: int, warmup: int) -> list[dict]:
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    per_rank = elastic_launch(config, worker)(variants, threads, steps, warmup)
    return [r for rank in sorted(per_rank) for r in per_rank[rank]]


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {key: statistics.median(r[key] for r in rows) for key in ("samples_per_s", "peak_rss_mib", "state_mib")}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--global-batch", type=int, default=64, help="strong scaling: the global batch")
    p.add_argument("--batch", type=int, default=32, help="weak scaling: the per-process batch")
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)), help="cores to share out")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    p.set_defaults(steps=8, warmup=3, repeats=2)
    args = p.parse_args()
    if args.quick:
        args.steps, args.warmup, args.repeats = 2, 1, 1
        args.global_batch, args.batch = 32, 16
    models = args.models.split(",")
    n = 2
    one = [(m, mode, "single", b) for m in models for mode, b in (("strong", args.global_batch), ("weak", args.batch))]
    two = [
        (m, mode, par, b)
        for m in models
        for par in ("ddp", "fsdp")
        for mode, b in (("strong", args.global_batch // n), ("weak", args.batch))
    ]
    # Launches alternate (1, N, 1, N ...) so that a load that comes and goes hits both;
    # each number is the median over repeats.
    singles, multis = [], []
    for _ in range(args.repeats):
        singles += launch(1, one, args.cores, args.steps, args.warmup)
        multis += launch(n, two, max(1, args.cores // n), args.steps, args.warmup)
    base = {
        (m, mode): _median([r for r in singles if (r["model"], r["mode"]) == (m, mode)])
        for m, mode, _, _ in one
    }
    results = multis

    print(
        f"\nscaling from 1 process x {args.cores} threads to {n} processes x {max(1, args.cores // n)} threads "
        f"(gloo, CPU; strong: global batch {args.global_batch}; weak: {args.batch} per process; "
        f"{args.steps} timed steps after {args.warmup})"
    )
    header = (
        f"{'model':<15} {'mode':<7} {'parallel':<8} {'procs':>5} {'samples/s':>10} {'efficiency':>10} "
        f"{'peak RSS MiB/proc':>18} {'params+optim MiB/proc':>22}"
    )
    print(header)
    for model_name in models:
        for mode in ("strong", "weak"):
            b = base[(model_name, mode)]
            print(
                f"{model_name:<15} {mode:<7} {'-':<8} {1:>5} {b['samples_per_s']:>10.1f} {1.0:>10.2f} "
                f"{b['peak_rss_mib']:>18.0f} {b['state_mib']:>22.1f}"
            )
            for par in ("ddp", "fsdp"):
                rows = [r for r in results if (r["model"], r["mode"], r["parallel"]) == (model_name, mode, par)]
                # Every rank times the same global steps: rank 0's, median over repeats.
                throughput = _median([r for r in rows if r["rank"] == 0])["samples_per_s"]
                rss = max(r["peak_rss_mib"] for r in rows)
                state = max(r["state_mib"] for r in rows)
                # Strong: the speed-up over one process, over N; weak: throughput over N x one's.
                efficiency = throughput / (n * b["samples_per_s"])
                print(
                    f"{model_name:<15} {mode:<7} {par:<8} {n:>5} {throughput:>10.1f} {efficiency:>10.2f} "
                    f"{rss:>18.0f} {state:>22.1f}"
                )


if __name__ == "__main__":
    main()
