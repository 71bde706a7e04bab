"""The example third-party plugin, installed as a package and found through its
entry point, as a user's own plugin would be."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "step_timer"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    # Built from a copy: pip builds a local folder in place, and the repository's
    # folder is shared with every other test process.
    source = shutil.copytree(EXAMPLE, tmp_path_factory.mktemp("source") / EXAMPLE.name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    return target


def _env(site):
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    }


def test_the_example_is_found_through_its_entry_point(installed):
    out = subprocess.run(
        [sys.executable, "-m", "slipstream", "algorithms", "--json"],
        env=_env(installed),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    entry = next(item for item in json.loads(out) if item["name"] == "step_timer")
    assert entry["distribution"] == "slipstream-step-timer"
    assert entry["version"] == "0.1.0"
    assert entry["error"] is None
    assert entry["summary"].startswith("Reports median and p90")


def test_training_with_the_example_plugin(installed, tmp_path, monkeypatch, capsys):
    # In this process (the listing above starts an interpreter as a user would): the
    # package's folder on sys.path is all entry-point discovery needs.
    from slipstream.cli.main import main

    monkeypatch.syspath_prepend(str(installed))
    run_dir = tmp_path / "run"
    code = main(
        [
            "train",
            "--quiet",
            "--algorithms",
            "step_timer",
            "model.name=test_resnet",
            "data.train_size=64",
            "data.val_size=32",
            "data.image_size=16",
            "data.batch_size=16",
            "trainer.max_duration=6ba",
            "trainer.log_interval=2",
            "algorithms.step_timer.skip_first=1",
            f"trainer.run_dir={run_dir}",
            "trainer.threads=1",
        ]
    )
    assert code == 0, capsys.readouterr().err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step_time_ms"]["steps"] == 5
    timer = next(a for a in summary["algorithms"] if a["name"] == "step_timer")
    assert timer["distribution"] == "slipstream-step-timer"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["step_ms"] > 0 for r in records if r["kind"] == "train")
