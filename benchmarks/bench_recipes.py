"""Whole recipes side by side in one process (the first is the baseline): final
accuracy, wall time, MFU, and the time-to-accuracy speed-up, the claim that counts:
how much sooner each run reaches the baseline's final accuracy (or --target).

    .venv/bin/python benchmarks/bench_recipes.py resnet18_baseline resnet18_fast [--threads 2] [-o key=value ...]
    .venv/bin/python benchmarks/bench_recipes.py resnet18_baseline resnet18_fast --quick   # a smoke run
    .venv/bin/python benchmarks/bench_recipes.py resnet18_baseline my_variant.yaml   # recipe paths work too
    .venv/bin/python benchmarks/bench_recipes.py default default+sam default+mixup+cutmix   # + adds algorithms

Time to accuracy is read from each run's eval records (``elapsed_s``), as
``slipstream compare`` does; run the recipes one after another on a quiet machine.

Two readings of "2.5x sooner" are printed. The claim (``compare``'s column): the
baseline's time to the target over each run's. The reference recipes' test (issue 8):
each run's time to the baseline's final accuracy minus half a point, against the
baseline's whole wall time. They differ when the baseline's accuracy swings: a
baseline that ends below its best reached its final value early, which shortens the
first reading but not the second.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from slipstream.cli.main import exit_code, user_error_message
from slipstream.config.schema import build_config
from slipstream.run.build import build_trainer
from slipstream.run.results import compare_runs, compare_runs_json, load_run, time_to_accuracy

# A smoke run: every recipe for a couple of epochs on a tenth of the data.
QUICK = ["trainer.max_duration=2ep", "data.train_size=512", "data.val_size=256"]
# The reference recipes' test: the fast recipe reaches the baseline's final accuracy,
# less this many points, in at most 1/2.5 of the baseline's wall time.
SLACK_PCT = 0.5


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipes", nargs="+")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="keep the run directories here")
    p.add_argument("--override", "-o", action="append", default=[], help="key=value applied to every recipe")
    p.add_argument(
        "--target", type=float, default=None, help="accuracy to time (default: the baseline's final accuracy)"
    )
    p.add_argument("--quick", action="store_true", help="a smoke run: " + " ".join(QUICK))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_recipes_"))
    runs = []
    for i, name in enumerate(args.recipes):
        # The same recipe twice (a noise check) gets two run directories.
        # RECIPE+a+b: the recipe with algorithms a and b enabled too (--algorithms a,b).
        recipe, _, extra = name.partition("+")
        stem = Path(recipe).stem + (f"+{extra}" if extra else "") if recipe.endswith((".yaml", ".yml")) else name
        label = stem if args.recipes.index(name) == i else f"{stem}-{i + 1}"
        overrides = [
            *(QUICK if args.quick else []),
            *args.override,
            f"trainer.threads={args.threads}",
            f"trainer.run_dir={out / label}",
            "trainer.progress_bar=false",
        ]
        try:
            cfg = build_config(recipe, extra.replace("+", ",") or None, overrides)
            trainer = build_trainer(cfg, label=name, verbose=False)
            summary = trainer.fit()
        except Exception as exc:  # a user error (a used --out, a bad recipe): its message, as the CLI prints it
            message = user_error_message(exc)
            if message is None:
                raise
            sys.exit(f"bench_recipes: {label}: {message}")
        if summary["status"] == "interrupted":  # Ctrl-C or SIGTERM: the user wants the benchmark over
            print(f"{label}: interrupted; runs kept in {out}", file=sys.stderr)
            sys.exit(exit_code(summary))
        runs.append(load_run(out / label))
        print(compare_runs(runs, args.target), flush=True)
    rows = compare_runs_json(runs, args.target)
    target = rows[0]["target_accuracy_pct"]
    print(f"\ntime to {'-' if target is None else f'{target:.2f} %'} (the claim), one process, {args.threads} threads:")
    for row in rows:
        speedup, mfu = row["time_to_target_speedup"], row["mfu"]
        reached = "never reached" if row["time_to_target_s"] is None else f"{row['time_to_target_s']:.1f} s"
        print(
            f"  {row['run']:<24} {reached:>14}  "
            f"speed-up {'-' if speedup is None else f'{speedup:.2f}x':>6}  "
            f"MFU {'-' if mfu is None else f'{100 * mfu:.1f} %':>7}  "
            f"peak memory {row['peak_memory_mb'] or 0:.0f} MiB"
        )
    base = rows[0]
    if base["final_accuracy_pct"] is not None and base["wall_time_s"]:
        within = (base["final_accuracy_pct"] - SLACK_PCT) / 100.0
        print(
            f"\ntime to {100 * within:.2f} % (the baseline's final - {SLACK_PCT} point) against the "
            f"baseline's wall time {base['wall_time_s']:.1f} s:"
        )
        for run, row in zip(runs, rows, strict=True):
            reached = time_to_accuracy(run, within)
            when = "never reached" if reached is None else f"{reached:.1f} s"
            ratio = "-" if reached is None else f"{base['wall_time_s'] / reached:.2f}x"
            print(f"  {row['run']:<24} {when:>14}  {ratio:>6}")
    print(f"runs kept in {out}")


if __name__ == "__main__":
    main()
