"""tools/gpu_check.sh: its dry run (the device check's steps at toy size on the
CPU) installs the engine offline, runs the pair and writes the report; a missing
prerequisite is one line and exit 2; a bad argument is refused."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_check.sh"


def _gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu_out")
    env = {
        **os.environ,
        "OUT": str(out),
        "PYTHON": sys.executable,
        "TMPDIR": str(tmp_path_factory.mktemp("gpu_work")),
        # The suite collects (and skips) the CUDA tests itself: not a second time here.
        "GPU_CHECK_SKIP": "cuda_tests",
        "GPU_CHECK_PAIR": "1",  # on a GPU the pair is run apart; here every step runs
    }
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=env, timeout=300)
    return result, out


def test_the_dry_run_installs_offline_trains_the_pair_and_reports(dry_run):
    result, out = dry_run
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout.startswith("gpu_check: prerequisites ok:")
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["dry_run"] is True
    assert {name: step["exit"] for name, step in report["steps"].items()} == {
        "install": 0, "cuda_tests": None, "pipeline": 0, "baseline": 0, "fast": 0, "plain_loop": 0, "decode": 0,
    }
    install_log = (out / "install.log").read_text()
    assert "algorithms load from" in install_log  # the engine and plugins came from the temporary target
    pair = report["pair"]
    assert pair["baseline"]["status"] == pair["fast"]["status"] == "completed"
    assert pair["baseline"]["final_accuracy_pct"] is not None and pair["fast"]["compute_dtype"] == "bf16"
    assert pair["fast"]["compile_time_s"] is not None  # torch_compile was in the fast run
    text = (out / "gpu_check.txt").read_text()
    assert "time-to-accuracy pair" in text and "baseline" in text and "fast" in text
    # The network in a hand-written loop and through the Trainer: the pair's MFU reference.
    assert report["plain_loop"][0].startswith("hand-written loop") and "through slipstream.Trainer" in text
    # Training from JPEG shards against a batch on the device, decode=cpu and gpu (issue 41's goals).
    assert report["pipeline"][0].endswith("steps 2-6 timed") and "the input pipeline" in text
    assert report["pipeline"][-1].startswith("pipeline data/on-device images/s:")
    assert {"on-device", "data, decode=cpu", "data, decode=gpu"} <= {line[:18].strip() for line in report["pipeline"]}
    # data.decode=gpu against cpu (in the dry run the "gpu" side decodes on the CPU).
    assert report["decode"][-1].startswith("data.decode gpu/cpu images/s:") and "JPEG decoding" in text
    assert len(list(out.iterdir())) <= 8  # what comes back from the device machine's $OUT


def test_a_missing_prerequisite_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    gpu_check = _gpu_check_module()
    monkeypatch.setattr(gpu_check, "CARRIED", {"no_such_module_here": "no-such-dist"})
    assert gpu_check.prereq(tmp_path / "no-wheels", dry_run=True) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpu_check: missing: wheels for no-such-dist")
    assert "make gpu-wheels" in err[0]


def test_an_unknown_argument_is_refused_with_what_is_allowed():
    result = subprocess.run(["bash", str(SCRIPT), "--fast"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == "gpu_check.sh: unknown argument '--fast'; allowed: --dry-run, --help"


def test_every_cuda_test_file_is_in_the_device_checks_list():
    """A CUDA test the device check does not name never runs anywhere: the suite skips
    it without a GPU, and the device machine runs only the files listed."""
    script = (ROOT / "tools" / "gpu_check.sh").read_text()
    marked = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"^(\s*@pytest\.mark\.cuda\b|pytestmark = (CUDA|pytest\.mark\.cuda))", p.read_text(), re.MULTILINE)
    )
    assert marked and [m for m in marked if m not in script] == []
