"""Run every per-algorithm benchmark, one after the other (never in parallel: they
time the machine), and say which failed. `make bench` runs this.

    .venv/bin/python benchmarks/run_all.py               # full runs: the cards' numbers (an hour or more)
    .venv/bin/python benchmarks/run_all.py --quick       # smoke: each script at tiny sizes
    .venv/bin/python benchmarks/run_all.py --only ema,channels_last --repeats 5

Extra arguments go to every script. The whole-recipe comparison is separate:
`benchmarks/bench_recipes.py resnet18_baseline resnet18_fast`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def scripts() -> dict[str, Path]:
    return {
        p.stem.removeprefix("bench_"): p for p in sorted(HERE.glob("bench_*.py")) if p.stem != "bench_recipes"
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated names, e.g. ema,channels_last")
    args, passthrough = p.parse_known_args()
    available = scripts()
    chosen = [n.strip() for n in args.only.split(",") if n.strip()] or list(available)
    unknown = [n for n in chosen if n not in available]
    if unknown:
        print(f"unknown benchmark(s) {', '.join(unknown)}; available: {', '.join(available)}", file=sys.stderr)
        return 2
    failed = []
    for name in chosen:
        print(f"\n=== {name}: {available[name].name} {' '.join(passthrough)}", flush=True)
        start = time.perf_counter()
        result = subprocess.run([sys.executable, str(available[name]), *passthrough], cwd=HERE.parent)
        print(f"=== {name}: exit {result.returncode} in {time.perf_counter() - start:.0f} s", flush=True)
        if result.returncode != 0:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
