"""What each bundled callback costs: the import of its module (what `slipstream
callbacks` pays), the import of its library (paid at `init` by a run that enables
it), and in a tiny run the time of its `fit_start` (where a tracker starts its run:
`wandb.init`, an MLflow run), per metrics record in `log_metrics`, and of `fit_end`.

    .venv/bin/python benchmarks/callback_cost.py [--records 40]

Each import is timed in a fresh interpreter that has already imported slipstream
(torch included), so the numbers are what the callback adds.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# callback name -> (its module, the library its init imports)
CALLBACKS = {
    "early_stopping": ("slipstream_early_stopping", None),
    "profiler": ("slipstream_profiler", "torch.profiler"),
    "tensorboard": ("slipstream_tensorboard", "torch.utils.tensorboard"),
    "mlflow": ("slipstream_mlflow", "mlflow.tracking"),
    "wandb": ("slipstream_wandb", "wandb"),
}

IMPORT = """
import importlib, json, sys, time
import slipstream
slipstream.Trainer  # slipstream's exports are lazy: this imports the engine and torch
out = {}
for key, name in (("module", sys.argv[1]), ("library", sys.argv[2])):
    if name == "-":
        out[key] = 0.0
        continue
    started = time.perf_counter()
    importlib.import_module(name)
    out[key] = time.perf_counter() - started
print(json.dumps(out))
"""


def import_cost(module: str, library: str | None) -> dict[str, float]:
    result = subprocess.run(
        [sys.executable, "-c", IMPORT, module, library or "-"], capture_output=True, text=True, check=True
    )
    return json.loads(result.stdout)


def run_cost(name: str, records: int) -> dict[str, float]:
    """Seconds for fit_start, per log_metrics call and for fit_end, in a run of
    ``records`` train records."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import torch

    from helpers import tiny_loaders, tiny_model
    from slipstream import Trainer
    from slipstream.plugins.discovery import CALLBACKS_GROUP, discover, instantiate

    (callback,) = instantiate({name: None}, discover(load=False, group=CALLBACKS_GROUP), CALLBACKS_GROUP)
    spent = {"fit_start": 0.0, "log_metrics": 0.0, "calls": 0, "fit_end": 0.0}
    for hook in ("fit_start", "log_metrics", "fit_end"):
        original = getattr(callback, hook, None)
        if original is None:
            continue

        @functools.wraps(original)  # pluggy reads the hook's arguments through it
        def timed(*args, _original=original, _hook=hook, **kwargs):
            started = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[_hook] += time.perf_counter() - started
                spent["calls"] += _hook == "log_metrics"

        setattr(callback, hook, timed)
    train, val = tiny_loaders()
    model = tiny_model()
    with tempfile.TemporaryDirectory() as tmp:
        Trainer(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
            train_data=train,
            eval_data=val,
            max_duration=f"{records}ba",
            log_interval=1,
            callbacks=[callback],
            run_dir=Path(tmp) / "run",
            device="cpu",
            progress_bar=False,
            verbose=False,
        ).fit()
    return {
        "fit_start_s": spent["fit_start"],
        "per_record_ms": 1000 * spent["log_metrics"] / max(spent["calls"], 1),
        "fit_end_s": spent["fit_end"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=40, help="train records (batches) in the timed run")
    parser.add_argument("--only", default=None, help="comma-separated callback names")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(CALLBACKS)
    print(
        f"{'callback':<15} {'module s':>9} {'library s':>10} {'fit_start s':>12} {'ms/record':>10} {'fit_end s':>10}"
    )
    for name in names:
        module, library = CALLBACKS[name]
        imports = import_cost(module, library)
        ran = run_cost(name, args.records)
        print(
            f"{name:<15} {imports['module']:>9.3f} {imports['library']:>10.2f} {ran['fit_start_s']:>12.2f} "
            f"{ran['per_record_ms']:>10.2f} {ran['fit_end_s']:>10.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
