"""sam: the cost of a SAM step (a second forward and backward) against a plain one.

Step time of ResNet-18 at 32 px (timm, ImageNet stem) through the real Trainer,
without sam, with sam every step and with interval=2, interleaved in one process.
Expect about 2x for every step and about 1.5x for interval=2.

    .venv/bin/python benchmarks/bench_sam.py --threads 1          # ~1 min idle
    .venv/bin/python benchmarks/bench_sam.py --quick
"""

from __future__ import annotations

from typing import Any

from slipstream_sam import Sam, SamConfig

from common import sgd_variant, step_args, time_variants


def bench(model_name: str, size: int, batch: int, args: Any) -> None:
    def variant(**options: Any):
        return sgd_variant(model_name, size, (lambda: [Sam(SamConfig(**options))]) if options else None)

    variants = {"no sam": variant(), "sam": variant(rho=0.05), "sam interval=2": variant(interval=2)}
    time_variants(variants, args, size=size, batch=batch,
                  title=f"{model_name} at {size} px, batch {batch}, {args.threads} threads")  # fmt: skip


def main() -> None:
    args = step_args(__doc__.splitlines()[0])
    bench("resnet18", 32, 16 if args.quick else 32, args)


if __name__ == "__main__":
    main()
