"""Callbacks through the command line, end to end: `slipstream callbacks --json`,
`--callbacks` on top of a recipe's `callbacks:` section with a dotted override, and
the clean error for an unknown name."""

from __future__ import annotations

import json
import subprocess
import sys

from slipstream.cli.main import main

TINY = [
    "model.name=test_resnet",
    "data.train_size=64",
    "data.val_size=32",
    "data.image_size=16",
    "data.batch_size=16",
    "trainer.threads=1",
    "trainer.progress_bar=false",
    "trainer.autotune=false",  # also run in a subprocess, where tests/conftest.py cannot fix the variants
]

# One interpreter (each start pays ~3 s of imports): `slipstream callbacks --json`,
# which heavy libraries that imported, then `slipstream train` with the given arguments.
SCRIPT = """
import json, sys
from slipstream.cli.main import main
listed = main(["callbacks", "--json"])
loaded = sorted(m for m in ("mlflow", "wandb", "tensorboard") if m in sys.modules)
print(json.dumps({"listed": listed, "loaded": loaded}))
sys.exit(main(["train", *sys.argv[1:]]))
"""


def test_callbacks_listing_and_a_run_with_recipe_and_flag(tmp_path):
    # A recipe enables early stopping (an improvement of 1.0 in accuracy never comes,
    # so it stops at the 2nd evaluation); --callbacks adds the profiler.
    recipe = tmp_path / "r.yaml"
    recipe.write_text("callbacks:\n  early_stopping: {patience: 1, min_delta: 1.0}\n")
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable, "-c", SCRIPT, "--recipe", str(recipe), "--callbacks", "profiler", *TINY,
            "callbacks.profiler.wait=0", "callbacks.profiler.warmup=0", "callbacks.profiler.active=1",
            "trainer.max_duration=2ep", "trainer.eval_interval=1ba", f"trainer.run_dir={run_dir}",
        ],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    decoder = json.JSONDecoder()
    listing, end = decoder.raw_decode(result.stdout)
    status = decoder.raw_decode(result.stdout, end + 1)[0]
    assert status == {"listed": 0, "loaded": []}  # listing imports no logger library
    entries = {e["name"]: e for e in listing}
    assert set(entries) >= {"early_stopping", "mlflow", "profiler", "tensorboard", "wandb"}
    assert entries["tensorboard"]["distribution"] == "slipstream-tensorboard"
    assert all(e["error"] is None and e["summary"] for e in entries.values())

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped_early" and summary["batches"] == 2
    assert [c["name"] for c in summary["callbacks"]] == ["early_stopping", "profiler"]
    assert summary["callbacks"][1]["config"]["active"] == 1
    assert summary["algorithms"] == []
    assert list((run_dir / "profiler").glob("trace-step*.json"))
    assert "stopped early" in result.stderr and "callbacks: early_stopping, profiler" in result.stderr

def test_an_unknown_callback_is_a_clean_error(tmp_path, capsys):
    # In process: the same main() as the console script, without another interpreter start.
    assert main(["train", "--callbacks", "tensorbord", *TINY, f"trainer.run_dir={tmp_path / 'b'}"]) == 2
    err = capsys.readouterr().err
    assert "unknown callback 'tensorbord' (did you mean 'tensorboard'?); installed callbacks:" in err
    assert "Traceback" not in err and not (tmp_path / "b").exists()
