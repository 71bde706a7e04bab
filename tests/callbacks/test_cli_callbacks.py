"""Callbacks through the command line, end to end: `slipstream callbacks --json`,
`--callbacks` on top of a recipe's `callbacks:` section with a dotted override, and
the clean error for an unknown name."""

from __future__ import annotations

import json
import subprocess
import sys

from slipstream.cli import main

TINY = [
    "model.name=test_resnet",
    "data.train_size=64",
    "data.val_size=32",
    "data.image_size=16",
    "data.batch_size=16",
    "trainer.threads=1",
    "trainer.progress_bar=false",
]

# `slipstream callbacks --json`, then which heavy libraries the listing imported.
LIST = (
    "import sys; from slipstream.cli import main; code = main(['callbacks', '--json']); "
    "print(sorted(m for m in ('mlflow', 'wandb', 'tensorboard') if m in sys.modules), file=sys.stderr); "
    "sys.exit(code)"
)


def run(*args, cwd=None):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd)


def test_callbacks_listing_and_a_run_with_recipe_and_flag(tmp_path):
    listing = run("-c", LIST)
    assert listing.returncode == 0, listing.stderr
    entries = {e["name"]: e for e in json.loads(listing.stdout)}
    assert set(entries) >= {"early_stopping", "mlflow", "profiler", "tensorboard", "wandb"}
    assert entries["tensorboard"]["distribution"] == "slipstream-tensorboard"
    assert all(e["error"] is None and e["summary"] for e in entries.values())
    assert listing.stderr.strip().endswith("[]")  # listing imports no logger library

    # A recipe enables early stopping (an improvement of 1.0 in accuracy never comes,
    # so it stops at the 2nd evaluation); --callbacks adds the profiler.
    recipe = tmp_path / "r.yaml"
    recipe.write_text("callbacks:\n  early_stopping: {patience: 1, min_delta: 1.0}\n")
    run_dir = tmp_path / "run"
    result = run(
        "-m", "slipstream", "train", "--recipe", str(recipe), "--callbacks", "profiler", *TINY,
        "callbacks.profiler.wait=0", "callbacks.profiler.warmup=0", "callbacks.profiler.active=1",
        "trainer.max_duration=2ep", "trainer.eval_interval=1ba", f"trainer.run_dir={run_dir}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped_early" and summary["batches"] == 2
    assert [c["name"] for c in summary["callbacks"]] == ["early_stopping", "profiler"]
    assert summary["callbacks"][1]["config"]["active"] == 1
    assert list((run_dir / "profiler").glob("trace-step*.json"))
    assert "stopped early" in result.stderr and "callbacks: early_stopping, profiler" in result.stderr



def test_an_unknown_callback_is_a_clean_error(tmp_path, capsys):
    # In process: the same main() as the console script, without another interpreter start.
    assert main(["train", "--callbacks", "tensorbord", *TINY, f"trainer.run_dir={tmp_path / 'b'}"]) == 2
    err = capsys.readouterr().err
    assert "unknown callback 'tensorbord' (did you mean 'tensorboard'?); installed callbacks:" in err
    assert "Traceback" not in err and not (tmp_path / "b").exists()
