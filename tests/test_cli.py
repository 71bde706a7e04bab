"""The command line, run as a user runs it: a subprocess, exit codes, messages,
and no traceback for a user's mistake. Tests of what a command says and writes (not of
how the process starts or exits) call its entry point in-process, `in_process`, which
returns the same exit code and output without a second interpreter importing torch
(a few seconds of CPU each)."""

import contextlib
import io
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from helpers import record_worker_shutdowns
from slipstream.cli.main import main

TINY = [
    "model.name=test_resnet",
    "data.train_size=64",
    "data.val_size=32",
    "data.image_size=16",
    "data.batch_size=16",
    "trainer.threads=1",
]


def slipstream(*args, cwd=None, env=None):
    return subprocess.run(
        [sys.executable, "-m", "slipstream", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )


def in_process(*args):
    """``slipstream ARGS`` through the console script's entry point, in this process:
    its exit code and what it printed. An exception the CLI lets escape fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse's own exits
            code = exit_.code
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run from an empty directory: a default run directory would land there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def assert_clean_error(result, *fragments):
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def test_help_lists_the_commands():
    result = slipstream("--help")
    assert result.returncode == 0
    for command in ("train", "algorithms", "callbacks", "recipes", "average", "plot", "compare", "compatibility"):
        assert command in result.stdout


def test_console_script_and_module_behave_the_same():
    script = os.path.join(os.path.dirname(sys.executable), "slipstream")
    if not os.path.exists(script):
        pytest.skip("the console script is installed only in the project's .venv (make test)")
    a = subprocess.run([script, "recipes"], capture_output=True, text=True)
    b = slipstream("recipes")
    assert a.returncode == b.returncode == 0 and a.stdout == b.stdout


def test_the_command_runs_its_garbages_finalizers_before_its_quick_exit(tmp_path):
    """``console()`` freezes what is alive at exit out of the last garbage collections;
    what the command left in a reference cycle must still be finalized first (with only
    ``gc.freeze`` this object's ``__del__`` never runs), and the exit code passes through."""
    marker = tmp_path / "finalized"
    script = f"""
import os
import slipstream.cli.main as cli
class Cyclic:
    def __init__(self):
        self.me = self
    def __del__(self):
        fd = os.open({str(marker)!r}, os.O_WRONLY | os.O_CREAT)
        os.write(fd, b"yes")
        os.close(fd)
def command():
    Cyclic()
    return 3
cli.main = command
cli.console()
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 3, result.stderr
    assert marker.read_text() == "yes"


def test_the_console_script_is_the_quick_exit_entry_point():
    from importlib.metadata import entry_points

    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "slipstream"]
    assert script.value == "slipstream.cli.main:console"


@pytest.mark.parametrize(
    "args, told",
    [
        (["trainer.max_duraton=1ep"], "unknown key 'trainer.max_duraton'"),
        (["--algorithms", "mixed_precison"], "unknown algorithm 'mixed_precison'"),
        (["algorithms.mixed_precision.dtype=bf17"], "dtype must be one of"),
    ],
)
def test_a_mistake_in_the_config_is_told_before_the_models_and_data_libraries_load(args, told):
    """Checking the config and its plugins needs torch, not torchvision or timm: a typo
    is answered 2-4 s sooner than after importing them."""
    script = (
        "import sys; from slipstream.cli.main import main; "
        f"code = main(['train', *{args!r}]); "
        "print(code, sorted(m for m in ('torchvision', 'timm') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert told in result.stderr
    assert result.stdout.split() == ["2", "[]"], result.stdout


def test_recipes_lists_the_bundled_ones(tmp_path):
    result = slipstream("recipes", cwd=tmp_path)  # from any working directory
    assert result.returncode == 0 and "default" in result.stdout
    listed = json.loads(slipstream("recipes", "--json").stdout)
    assert any(r["name"] == "default" for r in listed)


def test_algorithms_json_is_machine_readable():
    result = slipstream("algorithms", "--json")
    assert result.returncode == 0
    for entry in json.loads(result.stdout):
        assert set(entry) >= {"name", "distribution", "version", "summary", "error"}


def test_train_runs_and_writes_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    result = slipstream(
        "train", *TINY, "trainer.max_duration=2ep", "trainer.eval_interval=1ep", f"trainer.run_dir={run_dir}"
    )
    assert result.returncode == 0, result.stderr
    assert "accuracy" in result.stdout and "run directory" in result.stdout  # the summary table
    # The default recipe enables bf16, channels-last and a per-step LR schedule.
    order = next(line for line in result.stderr.splitlines() if "algorithms in order:" in line)
    assert all(name in order for name in ("stepwise_lr", "mixed_precision", "channels_last"))
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "checkpoints/latest.pt"):
        assert (run_dir / name).exists(), name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary) >= {
        "accuracy",
        "wall_time_s",
        "samples_per_s",
        "algorithms",
        "versions",
        "device",
        "world_size",
        "mfu",
        "peak_memory_mb",
        "peak_source",
        "time_to_target_s",
    }
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert len(evals) == 2
    assert set(train[0]) >= {
        "step",
        "epoch",
        "elapsed_s",
        "loss",
        "lr",
        "image_size",
        "samples_per_s",
        "mfu",
    }
    assert train[0]["image_size"] == [16, 16]
    assert set(evals[0]) >= {"step", "epoch", "loss", "accuracy"}
    config = (run_dir / "config.yaml").read_text()
    assert "test_resnet" in config and "max_duration: 2ep" in config


def test_unknown_algorithm(tmp_path, in_tmp):
    assert_clean_error(
        in_process(
            "train", "--algorithms", "mixed_precison", *TINY, f"trainer.run_dir={tmp_path / 'r'}"
        ),
        "unknown algorithm 'mixed_precison'",
        "installed algorithms:",
    )
    assert not (tmp_path / "r").exists()  # nothing written for a bad config


def test_misspelled_config_key(in_tmp):
    assert_clean_error(
        in_process("train", "data.batchsize=3"),
        "unknown key 'data.batchsize'",
        "did you mean 'data.batch_size'",
    )


def test_bad_duration(in_tmp):
    assert_clean_error(
        in_process("train", "trainer.max_duration=forever"),
        "trainer.max_duration",
        "is not a duration",
    )


def test_broken_recipe_file(tmp_path):
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("model: [unclosed\n")
    assert_clean_error(in_process("train", "--recipe", str(recipe)), "is not valid YAML")


def test_unknown_model_and_dataset(in_tmp):
    assert_clean_error(in_process("train", "model.name=resnet_19"), "unknown model 'resnet_19'")
    assert_clean_error(in_process("train", "data.name=mnist"), "mnist")
    assert not list(in_tmp.iterdir())  # nothing written


def test_corrupt_checkpoint(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"garbage")
    assert_clean_error(
        in_process(
            "train", *TINY, f"trainer.load_path={bad}", f"trainer.run_dir={tmp_path / 'run'}"
        ),
        "cannot be read: this is a text file, not a checkpoint",
    )


def test_a_plugin_that_fails_to_import(tmp_path, monkeypatch):
    from helpers import fake_distribution

    site = fake_distribution(
        tmp_path / "site",
        "slipstream-broken",
        {"broken": "broken_mod:Broken"},
        {"broken_mod": "raise ImportError('needs a GPU library')\n"},
    )
    # A fresh process finds it through PYTHONPATH (the console script end to end), and this
    # one through sys.path for the rest (each command reads the entry points anew).
    listing = slipstream("algorithms", "--check", env={"PYTHONPATH": str(site)})
    assert listing.returncode == 1  # a check that finds a broken plugin fails
    assert "1 of the algorithms failed to load: broken" in listing.stderr
    assert (
        "broken" in listing.stdout
        and "FAILED TO LOAD" in listing.stdout
        and "needs a GPU library" in listing.stdout
    )
    assert in_process("algorithms", "--check").returncode == 0  # without it, all load
    monkeypatch.syspath_prepend(str(site))
    # The plain listing reads metadata and imports no plugin: the failure shows with --check.
    plain = in_process("algorithms")
    assert plain.returncode == 0
    assert "broken" in plain.stdout and "FAILED TO LOAD" not in plain.stdout
    assert "--check" in plain.stdout
    assert in_process("algorithms", "--check", "--json").returncode == 1
    assert_clean_error(
        in_process("train", "--algorithms", "broken"),
        "slipstream-broken",
        "broken_mod:Broken",
        "needs a GPU library",
    )


def test_plot_and_compare(tmp_path, in_tmp):
    for name in ("a", "b"):
        result = in_process(
            "train",
            "--quiet",
            *TINY,
            "trainer.max_duration=4ba",
            f"trainer.run_dir={tmp_path / name}",
        )
        assert result.returncode == 0, result.stderr
    out = tmp_path / "plot.png"
    result = in_process("plot", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = in_process("compare", str(tmp_path / "a"), str(tmp_path / "b"))
    assert table.returncode == 0 and "a" in table.stdout and "b" in table.stdout
    assert "MFU %" in table.stdout and "time to" in table.stdout
    chosen = in_process("compare", str(tmp_path / "a"), "--target", "0.01", "--json")
    assert json.loads(chosen.stdout)[0]["target_accuracy_pct"] == pytest.approx(1.0)
    assert_clean_error(
        in_process("compare", str(tmp_path / "a"), "--target", "60"), "fraction in (0, 1]"
    )
    assert_clean_error(in_process("compare", str(tmp_path)), str(tmp_path))


def test_train_ends_its_persistent_loader_workers_before_returning(tmp_path, monkeypatch):
    # Left to the interpreter's exit, they made an H100 run's process wait 40 s after
    # its summary (Python 3.12: the 5 s join timeout, once per worker).
    seen = record_worker_shutdowns(monkeypatch)
    overrides = ["data.num_workers=2", "data.persistent_workers=true", "trainer.progress_bar=false"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(["train", *TINY, *overrides, "trainer.max_duration=1ep", f"trainer.run_dir={tmp_path / 'run'}"])
    assert code == 0
    # The training and the evaluation loader: each stopped when fit() returned, its workers alive
    # until then, and not left for the garbage collector's __del__.
    assert seen == [([True, True], "stop_workers")] * 2


def test_algorithms_given_twice_both_count():
    """argparse keeps only the last value of a repeated option: the first list was
    dropped without a word."""
    from slipstream.cli.main import _parser

    args = _parser().parse_args(["train", "--algorithms", "no:stepwise_lr,ema", "-a", "mixup", "--callbacks", "x"])
    assert args.algorithms == "no:stepwise_lr,ema,mixup" and args.callbacks == "x"
    assert _parser().parse_args(["train"]).algorithms is None
