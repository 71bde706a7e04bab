"""grad_clipping: the cost of clipping (it is a stabiliser, not a speed-up).

Step time of ResNet-18 at 32 px (timm, ImageNet stem) and ViT-tiny through the real
Trainer, without clipping, with clipping by norm and by value, interleaved in one
process. The ratio should stay close to 1.

    .venv/bin/python benchmarks/bench_grad_clipping.py          # ~1 min idle
    .venv/bin/python benchmarks/bench_grad_clipping.py --quick
"""

from __future__ import annotations

from typing import Any

from slipstream_grad_clipping import GradClipping, GradClippingConfig

from common import sgd_variant, step_args, time_variants


def bench(model_name: str, size: int, batch: int, args: Any, **model_kwargs: Any) -> None:
    def variant(**clip: float):
        return sgd_variant(
            model_name, size, (lambda: [GradClipping(GradClippingConfig(**clip))]) if clip else None, **model_kwargs
        )

    variants = {
        "no clipping": variant(),
        "max_norm=1.0": variant(max_norm=1.0),
        "clip_value=0.1 (+ norm log)": variant(clip_value=0.1),
    }
    time_variants(variants, args, size=size, batch=batch,
                  title=f"{model_name} at {size} px, batch {batch}, {args.threads} threads")  # fmt: skip


def main() -> None:
    args = step_args(__doc__.splitlines()[0])
    if args.quick:
        bench("resnet18", 32, 16, args)
        return
    bench("resnet18", 32, 64, args)
    bench("vit_tiny_patch16_224", 64, 32, args, patch_size=8)


if __name__ == "__main__":
    main()
