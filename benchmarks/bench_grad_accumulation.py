"""Gradient accumulation: ViT-tiny at 224 px, one batch of 32 against 4 accumulated
batches of 8 (the same effective batch). Reports peak training memory and time per
*sample* (the accumulated run takes 4 loop batches per optimizer step, so time per
loop batch is not comparable).

    .venv/bin/python benchmarks/bench_grad_accumulation.py            # ~3 min on 2 idle cores
    .venv/bin/python benchmarks/bench_grad_accumulation.py --quick    # ViT-tiny at 32 px, seconds
"""

from __future__ import annotations

import math

import timm
import torch
from slipstream_grad_accumulation import GradAccumulation, GradAccumulationConfig

from common import compare, parser, random_loader


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32, help="the big batch (default 32)")
    p.add_argument("--accum", type=int, default=4, help="accumulation steps (default 4)")
    p.add_argument("--image-size", type=int, default=224)
    p.set_defaults(steps=8, warmup=4, repeats=2)
    args = p.parse_args()
    if args.quick:
        args.image_size, args.steps, args.warmup, args.repeats = 32, 4, 4, 1
    torch.set_num_threads(args.threads)
    if args.batch % args.accum:
        p.error(f"--batch {args.batch} is not a multiple of --accum {args.accum}")
    small = args.batch // args.accum
    # Time whole accumulation groups only: warm-up and timed batches in multiples of N.
    warmup = math.ceil(args.warmup / args.accum) * args.accum
    steps = math.ceil(args.steps / args.accum) * args.accum

    def build(algorithms):
        def variant():
            torch.manual_seed(0)
            model = timm.create_model("vit_tiny_patch16_224", num_classes=10, img_size=args.image_size)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            return model, optimizer, algorithms()

        return variant

    big_name = f"batch {args.batch}"
    acc_name = f"{small} x {args.accum} accumulation"
    batch_size = {big_name: args.batch, acc_name: small}
    n = warmup + steps
    loaders = {name: random_loader(b * n, args.image_size, b) for name, b in batch_size.items()}
    variants = {
        big_name: build(list),
        acc_name: build(lambda: [GradAccumulation(GradAccumulationConfig(steps=args.accum))]),
    }
    results = compare(
        variants,
        loaders.__getitem__,
        steps=steps,
        warmup=warmup,
        repeats=args.repeats,
        measure_memory=True,
    )

    base = results[big_name]
    base_sample_s = base.median_step_s / args.batch
    print(
        f"ViT-tiny at {args.image_size} px, {args.threads} threads, {args.repeats} repetition(s), "
        f"{steps} timed loop batches after {warmup}"
    )
    print(f"{'variant':<24} {'ms/sample':>10} {'time':>7} {'peak MiB':>9} {'memory':>7}")
    for name, r in results.items():
        sample_s = r.median_step_s / batch_size[name]
        print(
            f"{name:<24} {1000 * sample_s:>10.2f} {sample_s / base_sample_s:>6.2f}x "
            f"{r.median_peak_mib:>9.1f} {r.median_peak_mib / base.median_peak_mib:>6.2f}x"
        )


if __name__ == "__main__":
    main()
