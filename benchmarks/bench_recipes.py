"""Whole recipes side by side in one process (the first is the baseline): final
accuracy, wall time and the wall-time speed-up, e.g. resnet18_baseline vs resnet18_fast.

    .venv/bin/python benchmarks/bench_recipes.py resnet18_baseline resnet18_fast [--threads 2] [key=value ...]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from slipstream.config import build_config
from slipstream.results import compare_runs, load_run
from slipstream.runner import build_trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("recipes", nargs="+")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="keep the run directories here")
    p.add_argument("--override", "-o", action="append", default=[], help="key=value applied to every recipe")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_recipes_"))
    runs = []
    for name in args.recipes:
        overrides = [*args.override, f"trainer.run_dir={out / name}", "trainer.progress_bar=false"]
        trainer = build_trainer(build_config(name, None, overrides), label=name, verbose=False)
        trainer.fit()
        runs.append(load_run(out / name))
        print(compare_runs(runs), flush=True)
    print(f"runs kept in {out}")


if __name__ == "__main__":
    main()
