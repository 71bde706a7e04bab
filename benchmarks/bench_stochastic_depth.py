"""stochastic_depth: what dropping residual blocks per sample costs per training step.

A hand-written loop (forward, cross-entropy, backward, SGD step) on random data, one
thread, with and without the plugin, variants interleaved step by step; the plugin's
own ``init`` and ``before_forward`` (the per-batch mask draw) run as in the engine.
CPU time per step (steadier than wall time on a shared machine), median over steps.

    .venv/bin/python benchmarks/bench_stochastic_depth.py            # ~1 min
    .venv/bin/python benchmarks/bench_stochastic_depth.py --steps 10
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import timm
import torch
import torch.nn.functional as F
import torchvision
from slipstream_stochastic_depth import StochasticDepth, StochasticDepthConfig

MODELS = {
    "timm test_resnet, 32 px, batch 32": (lambda: timm.create_model("test_resnet", num_classes=10), 32, 32),
    "torchvision resnet18, 32 px, batch 32": (lambda: torchvision.models.resnet18(num_classes=10), 32, 32),
    "timm vit_tiny, 32 px (patch 8), batch 32": (
        lambda: timm.create_model("vit_tiny_patch16_224", num_classes=10, img_size=32, patch_size=8),
        32,
        32,
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--drop-rate", type=float, default=0.1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, drop_rate {args.drop_rate}, {args.steps} steps per variant")
    print(f"{'model':<44} {'plain':>10} {'stochastic_depth':>18}")
    for label, (build, size, batch) in MODELS.items():
        loops = {}
        for variant in ("plain", "stochastic_depth"):
            torch.manual_seed(0)
            model = build().train()
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            plugin = None
            state = SimpleNamespace(unwrapped_model=model, device=torch.device("cpu"), summary={}, seed=0, rank=0,
                                    timestamp=SimpleNamespace(batch=0), batch=None)
            if variant == "stochastic_depth":
                plugin = StochasticDepth(StochasticDepthConfig(args.drop_rate))
                plugin.init(state)
            loops[variant] = (model, opt, plugin, state)
        x = torch.rand(batch, 3, size, size)
        y = torch.randint(0, 10, (batch,))
        times: dict[str, list[float]] = {v: [] for v in loops}
        for step in range(args.warmup + args.steps):
            for variant, (model, opt, plugin, state) in loops.items():
                start = time.process_time()
                if plugin is not None:
                    state.timestamp.batch, state.batch = step, (x, y)
                    plugin.before_forward(state)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if step >= args.warmup:
                    times[variant].append(time.process_time() - start)
        base = statistics.median(times["plain"])
        with_sd = statistics.median(times["stochastic_depth"])
        print(f"{label:<44} {1e3 * base:>8.1f} ms {1e3 * with_sd:>8.1f} ms ({with_sd / base:.3f}x)")


if __name__ == "__main__":
    main()
