"""Measured auto against every fixed variant, per recipe, in one process: does ``auto``
train at least 0.95x as fast per sample as the best fixed choice of precision and
memory format on this machine? (Issue 28.)

    .venv/bin/python benchmarks/bench_auto.py                          # default, resnet18_baseline, resnet18_fast
    .venv/bin/python benchmarks/bench_auto.py default --repeats 3 --duration 2ep
    .venv/bin/python benchmarks/bench_auto.py --quick                  # a smoke run

Each recipe runs with ``mixed_precision`` and ``channels_last`` on (added where the
recipe lacks them) in five ways: ``auto`` (dtype auto, mode auto: measured at fit
start), and fixed fp32/bf16 x NCHW/NHWC. The variants are interleaved (A B C D E A B
...) so that a noisy machine slows them alike; each cell is the median over the
repetitions of the run's ``samples_per_s`` (training time only: evaluation is off,
the decision is outside the run's clock). Every auto run measures afresh (its cache
entry is removed first; ``--keep-cache`` reuses it), and its decision cost is printed
against the run's training time and the whole recipe's (estimated from its own
throughput). bf16 is left out on a CPU without bf16 units (emulated, ~10x slower;
``--emulated-bf16`` times it anyway).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from slipstream.config.schema import build_config
from slipstream.duration import Duration
from slipstream.plugins.variants import cache_path
from slipstream.run.build import build_trainer
from slipstream.services.cpu_kind import describe_cpu_kind, native_bf16
from slipstream.services.peak_flops import device_label

RECIPES = ("default", "resnet18_baseline", "resnet18_fast")
GOAL = 0.95
BOTH = "mixed_precision,channels_last"
FIXED = {
    "fp32 NCHW": ("no:mixed_precision,no:channels_last", []),
    "fp32 NHWC": ("channels_last,no:mixed_precision", ["algorithms.channels_last.mode=always"]),
    "bf16 NCHW": ("mixed_precision,no:channels_last", ["algorithms.mixed_precision.dtype=bf16"]),
    "bf16 NHWC": (BOTH, ["algorithms.mixed_precision.dtype=bf16", "algorithms.channels_last.mode=always"]),
}
QUICK = ["trainer.max_duration=3ba", "data.train_size=512", "data.val_size=64"]


def run(recipe: str, algorithms: str, overrides: list[str], out: Path) -> dict:
    trainer = build_trainer(build_config(recipe, algorithms, [*overrides, f"trainer.run_dir={out}"]), verbose=False)
    return trainer.fit()


def whole_recipe_train_s(recipe: str, samples_per_s: float) -> float | None:
    """The recipe's own duration at this throughput (epochs only), for the cost's share."""
    cfg = build_config(recipe)
    duration = Duration.parse(cfg.trainer.max_duration)
    if duration.unit != "ep":
        return None
    per_epoch = (cfg.data.train_size // cfg.data.batch_size) * cfg.data.batch_size
    return duration.value * per_epoch / samples_per_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipes", nargs="*", default=list(RECIPES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--duration", default="2ep", help="trainer.max_duration of every run (default 2ep)")
    p.add_argument("--repeats", type=int, default=1, help="interleaved repetitions of every variant")
    p.add_argument("--keep-cache", action="store_true", help="auto runs after the first reuse its choice")
    p.add_argument("--emulated-bf16", action="store_true", help="time bf16 on a CPU without bf16 units too")
    p.add_argument("--quick", action="store_true", help="a smoke run: " + " ".join(QUICK))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    # "no:mixed_precision removes nothing" on a recipe without it is what a fixed variant means.
    warnings.filterwarnings("ignore", message="--algorithms no:")
    # A private cache (the peak-FLOP/s probe runs once here; auto's entries are ours to remove).
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="bench_auto_cache_")
    out = Path(tempfile.mkdtemp(prefix="bench_auto_"))
    common = [
        f"trainer.max_duration={args.duration}",
        "trainer.eval_interval=null",
        "trainer.checkpoint_interval=null",
        f"trainer.threads={args.threads}",
        "trainer.progress_bar=false",
        *(QUICK if args.quick else []),
    ]
    fixed = {k: v for k, v in FIXED.items() if args.emulated_bf16 or native_bf16() or not k.startswith("bf16")}
    cpu = device_label(torch.device("cpu"))
    features = (
        f"CPU kind {describe_cpu_kind()}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"native bf16 {native_bf16()}"
    )
    print(f"{cpu} ({features}), {args.threads} threads, torch {torch.__version__}", flush=True)
    rows = []
    for recipe in args.recipes:
        sps: dict[str, list[float]] = {"auto": [], **{k: [] for k in fixed}}
        choices, costs = [], []
        for rep in range(args.repeats):
            for variant in sps:
                where = out / recipe / f"{variant.replace(' ', '_')}-{rep}"
                if variant == "auto":
                    if not args.keep_cache:
                        cache_path().unlink(missing_ok=True)
                    summary = run(recipe, BOTH, common, where)
                    auto = summary.get("auto") or {}
                    choices.append(",".join(auto.get("choice", {}).values()) or "-")
                    costs.append(auto.get("cost_s", 0.0))
                else:
                    algorithms, overrides = fixed[variant]
                    summary = run(recipe, algorithms, [*common, *overrides], where)
                sps[variant].append(float(summary["samples_per_s"]))
                print(f"  {recipe} {variant} rep {rep + 1}: {sps[variant][-1]:.1f} samples/s", file=sys.stderr)
        median = {k: statistics.median(v) for k, v in sps.items()}
        best_name = max(fixed, key=lambda k: median[k])
        ratio = median["auto"] / median[best_name]
        full = whole_recipe_train_s(recipe, median["auto"])
        cost = statistics.median(costs)
        rows.append((recipe, median, best_name, ratio, choices, cost, full))
    names = ["auto", *fixed]
    print("\n| recipe | " + " | ".join(names) + " | auto / best fixed | auto chose | decision cost |")
    print("| --- " * (len(names) + 4) + "|")
    ok = True
    for recipe, median, best_name, ratio, choices, cost, full in rows:
        ok &= ratio >= GOAL
        cells = " | ".join(f"{median[k]:.1f}" for k in names)
        share = f" ({cost / full:.1%} of the recipe's {full:.0f} s)" if full else ""
        print(
            f"| {recipe} | {cells} | {ratio:.2f} (best: {best_name}) | {'; '.join(choices)} | {cost:.2f} s{share} |"
        )
    print(f"\nsamples/s per variant, median of {args.repeats}; goal auto >= {GOAL}x the best fixed: "
          f"{'met' if ok else 'NOT met'}; runs in {out}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
