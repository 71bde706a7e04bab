"""SIGINT and SIGTERM, sent for real to `slipstream train` in a subprocess: the run
ends after the current batch with a checkpoint there, status `interrupted` and exit
128 + the signal; a second signal aborts at once; a resume continues the metrics
log without duplicates."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import fake_distribution, train
from slipstream import load_checkpoint

# A plugin that keeps a tiny run busy long enough to be signalled and, when asked,
# makes the batch that received the signal a long one (to send the second signal in).
# It looks last at batch_end (trylast): a signal that landed after its look but before
# the loop's own would end the run at once, with no long batch to abort.
SLOW = """
import os, time
from slipstream import Algorithm, hookimpl

class Slow(Algorithm):
    name = "slow"

    @hookimpl(trylast=True)
    def batch_end(self, state):
        time.sleep(0.02)
        if state.stop_requested:
            time.sleep(float(os.environ.get("SLOW_LAST_BATCH_S", "0")))
"""

TINY = [
    "model.name=test_resnet",
    "data.train_size=64",
    "data.val_size=16",
    "data.image_size=16",
    "data.batch_size=8",
    "trainer.threads=1",
    "trainer.log_interval=1",
    "trainer.checkpoint_interval=1000ba",  # the only checkpoint is the interrupt's
]


@pytest.fixture
def cli(tmp_path):
    site = fake_distribution(tmp_path / "site", "slipstream-slow", {"slow": "slow_mod:Slow"},
                             {"slow_mod": SLOW})
    recipe = tmp_path / "plain.yaml"
    recipe.write_text("algorithms: {}\n")

    def start(run_dir, *overrides, env=None):
        args = [sys.executable, "-m", "slipstream", "train", "--quiet", "--recipe", str(recipe),
                "--algorithms", "slow", *TINY, f"trainer.run_dir={run_dir}", *overrides]
        err = (tmp_path / f"{run_dir.name}.stderr").open("w+")
        env = {**os.environ, "PYTHONPATH": str(site), **(env or {})}
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err, env=env, text=True)
        proc.stderr_file = err
        return proc

    return start


def train_records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def wait_for(condition, proc, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            proc.stderr_file.seek(0)
            pytest.fail(f"exited early ({proc.returncode}): {proc.stderr_file.read()[-2000:]}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def logged_some(run_dir, n=3):
    path = run_dir / "metrics.jsonl"
    return lambda: path.is_file() and len(path.read_text().splitlines()) >= n


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_the_run_after_the_batch_with_a_checkpoint(cli, tmp_path, signum, code):
    run_dir = tmp_path / "run"
    proc = cli(run_dir, "trainer.max_duration=100000ba")
    wait_for(logged_some(run_dir), proc)
    proc.send_signal(signum)
    assert proc.wait(timeout=120) == code
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert summary["interrupted_by"] == signal.Signals(signum).name
    stopped_at = summary["batches"]
    assert train_records(run_dir)[-1]["step"] == stopped_at  # the batch was finished and logged
    latest = load_checkpoint(run_dir / "checkpoints" / "latest.pt")
    assert latest["timestamp"]["batch"] == stopped_at
    # The reason names the step the run stopped at and checkpointed, not the one before it.
    name = signal.Signals(signum).name
    assert summary["stop_reason"] == f"interrupted by {name}: stopped after step {stopped_at}, with a checkpoint of it"
    if signum != signal.SIGINT:
        return

    # Resume in place: the log goes on from the checkpoint as one run.
    resumed = cli(run_dir, f"trainer.max_duration={stopped_at + 3}ba",
                  f"trainer.load_path={run_dir / 'checkpoints' / 'latest.pt'}")
    assert resumed.wait(timeout=120) == 0
    assert [r["step"] for r in train_records(run_dir)] == list(range(1, stopped_at + 4))
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_the_launcher_of_several_processes_exits_as_one_process_does(monkeypatch, signum, code):
    """SIGTERM to `slipstream train --nproc-per-node 2` (what a scheduler sends) reaches
    the elastic agent as its SignalException once it has passed the signal on: the
    launcher exits 143 (130 for SIGINT), not 1 with the agent's traceback, so a requeue
    script can tell a preemption from a failure."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from slipstream.cli.launch import LaunchOptions, launch

    def signalled(_config):
        raise SignalException(f"Process 1 got signal: {signum}", sigval=signal.Signals(signum))

    monkeypatch.setattr(torchrun, "run", signalled)
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))  # launch() sets it
    assert launch(LaunchOptions(nproc_per_node=2), ["--quiet"]) == code


def test_a_second_signal_aborts_at_once(cli, tmp_path):
    run_dir = tmp_path / "run"
    # The batch that receives the first signal would take a minute to finish. No
    # evaluation: a signal that lands in one is answered at the epoch's end, with a
    # checkpoint and no batch to send the second signal in.
    proc = cli(run_dir, "trainer.max_duration=100000ba", "trainer.eval_interval=null",
               env={"SLOW_LAST_BATCH_S": "60"})
    wait_for(logged_some(run_dir), proc)
    proc.send_signal(signal.SIGINT)

    def told():
        proc.stderr_file.seek(0)
        return "SIGINT received" in proc.stderr_file.read()

    wait_for(told, proc)
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    assert time.monotonic() - started < 30
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and "aborted by a second SIGINT" in summary["error"]
    assert not (run_dir / "checkpoints" / "latest.pt").exists()  # no time was spent on one
    # ... and the summary does not promise one.
    assert "aborted by a second SIGINT" in summary["stop_reason"] and "no checkpoint" in summary["stop_reason"]


def test_a_resume_from_an_earlier_checkpoint_drops_the_later_records(tmp_path):
    first = train(tmp_path, [], max_duration="6ba", log_interval=1, checkpoint_interval="2ba",
                  checkpoint_keep=5, eval_interval="2ba")
    early = first.run_dir / "checkpoints" / "ep0-ba2.pt"
    train(tmp_path, [], max_duration="4ba", log_interval=1, load_path=early, eval_interval="2ba")
    lines = (first.run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [(r["kind"], r["step"]) for r in map(json.loads, lines)]
    assert [s for kind, s in steps if kind == "train"] == [1, 2, 3, 4]
    assert [s for kind, s in steps if kind == "eval"] == [2, 4]
