"""matmul_precision on CPU: what float32 matmul precision does without a GPU.

On CUDA, "high" means TF32 tensor cores (not measurable here). On CPU, "high" changes
nothing, while "medium" lets oneDNN run fp32 matmuls (Linear layers) in bf16 on CPUs
that have it; convolutions are unaffected. ViT-tiny (matmul-bound) and ResNet-18
(convolution-bound, timm, ImageNet stem) through the real Trainer, interleaved; first,
one 512x1024 @ 1024x1024 fp32 matmul at each precision, its time and its error against
fp64 (what the switch does before any model is involved).

    .venv/bin/python benchmarks/bench_matmul_precision.py          # ~2 min idle
    .venv/bin/python benchmarks/bench_matmul_precision.py --matmul-only
    .venv/bin/python benchmarks/bench_matmul_precision.py --quick
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from slipstream_matmul_precision import MatmulPrecision, MatmulPrecisionConfig

from common import compare, parser, random_loader, report
from slipstream.models import build_model


def bench(model_name: str, size: int, batch: int, args: Any, **model_kwargs: Any) -> None:
    def variant(precision: str | None):
        def build():
            torch.manual_seed(0)
            model = build_model(model_name, 10, image_size=size, **model_kwargs)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            cfg = MatmulPrecisionConfig(precision=precision) if precision else None
            return model, optimizer, [MatmulPrecision(cfg)] if precision else []

        return build

    variants = {
        f"no plugin ({torch.get_float32_matmul_precision()})": variant(None),
        "precision=high": variant("high"),
        "precision=medium": variant("medium"),
    }
    data = random_loader(batch * (args.warmup + args.steps), size, batch)
    results = compare(variants, data, steps=args.steps, warmup=args.warmup, repeats=args.repeats)
    report(f"{model_name} at {size} px, batch {batch}, {args.threads} threads", results)


def standalone_matmul(repeats: int, threads: int) -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(512, 1024, generator=g), torch.randn(1024, 1024, generator=g)
    exact = a.double() @ b.double()
    previous = torch.get_float32_matmul_precision()
    times: dict[str, list[float]] = {p: [] for p in ("highest", "high", "medium")}
    errors: dict[str, float] = {}
    try:
        for _ in range(max(repeats, 1) * 5):  # interleaved: each reading next to the others
            for precision, readings in times.items():
                torch.set_float32_matmul_precision(precision)
                a @ b  # warm: oneDNN picks its kernel for this precision
                started = time.perf_counter()
                out = a @ b
                readings.append(time.perf_counter() - started)
                errors[precision] = ((out.double() - exact).abs().max() / exact.abs().max()).item()
    finally:
        torch.set_float32_matmul_precision(previous)
    print(f"one 512x1024 @ 1024x1024 fp32 matmul, {threads} thread(s), median of {len(times['high'])}")
    base = statistics.median(times["highest"])
    for precision, readings in times.items():
        median = statistics.median(readings)
        print(
            f"  {precision:<8} {1e3 * median:7.2f} ms  {base / median:5.2f}x  "
            f"max error vs fp64 (relative) {errors[precision]:.1e}"
        )


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.set_defaults(steps=8, warmup=2, repeats=3)
    p.add_argument("--matmul-only", action="store_true", help="only the standalone matmul")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    standalone_matmul(args.repeats, args.threads)
    if args.matmul_only:
        return
    if args.quick:
        args.steps, args.warmup, args.repeats = 3, 1, 1
        bench("vit_tiny_patch16_224", 64, 8, args, patch_size=8)
        return
    bench("vit_tiny_patch16_224", 224, 8, args)
    bench("resnet18", 32, 64, args)


if __name__ == "__main__":
    main()
