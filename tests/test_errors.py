"""Whole categories of user mistakes and environment faults end in one clear line
and exit code 2, never a traceback, and nothing is written for a refused start.

Most run `slipstream.cli.main.main` in-process (a subprocess costs a torch import each);
test_cli.py covers the subprocess path itself."""

from __future__ import annotations

import errno
import json
import sys
import urllib.error
import warnings
from pathlib import Path

import pytest
import torch

from helpers import TINY_RUN, colour_image_folder, error_lines, fake_distribution, train
from slipstream import CheckpointError, ConfigError
from slipstream.cli.main import main
from slipstream.config.options import TrainerOptions, check_output_dir
from slipstream.config.schema import build_config
from slipstream.errors import ConfigWarning, describe_os_error

TINY = [*TINY_RUN, "trainer.max_duration=1ba", "--quiet"]


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def assert_clean(code: int, err: str, *fragments: str, expected: int = 2) -> None:
    assert code == expected, err
    assert "Traceback" not in err
    errors = error_lines(err)
    assert len(errors) == 1 and errors[0].startswith("slipstream: error: "), err
    for fragment in fragments:
        assert fragment in err, err


# -- values handed on to torch and libraries -----------------------------------------


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("trainer.device=gpu", ["trainer.device='gpu' is not a device", "cuda:N"]),
        ("trainer.device=cuda:x", ["trainer.device='cuda:x' is not a device"]),
        ("trainer.threads=0", ["trainer.threads must be at least 1"]),
        ("trainer.threads=-1", ["trainer.threads must be at least 1"]),
        ("trainer.seed=99999999999999999999999", ["trainer.seed", "64 bits"]),
        ("optimizer.lr=1e400", ["optimizer.lr=inf", "finite"]),
        ("trainer.max_duration=1e400ep", ["trainer.max_duration", "too large"]),
        ("data.num_workers=100000", ["data.num_workers", "from 0 to"]),
        ("model.kwargs.depth=99999999999999999999", ["model.kwargs.depth", "64 bits"]),
        ("trainer.log_interval=0", ["trainer.log_interval must be at least 1"]),
    ],
)
def test_values_torch_would_reject_are_config_errors(capsys, tmp_path, override, fragments):
    run_dir = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", *TINY, override, f"trainer.run_dir={run_dir}")
    assert_clean(code, err, *fragments)
    assert not run_dir.exists()


def test_the_valid_neighbours_of_those_values_pass():
    TrainerOptions(device="cpu", threads=1, seed=2**63 - 1, log_interval=1).validate()
    cfg = build_config(None, None, ["optimizer.lr=1e-3", "data.num_workers=2"])
    assert cfg.optimizer.lr == 1e-3


def test_model_kwargs_are_checked_for_torchvision_as_for_timm(capsys, tmp_path):
    for name in ("timm/resnet18", "torchvision/resnet18"):
        code, _, err = run_cli(
            capsys, "train", *TINY, f"model.name={name}", "model.kwargs.no_such_arg=1",
            f"trainer.run_dir={tmp_path / 'run'}",
        )
        assert_clean(code, err, f"model {name} cannot be built", "no_such_arg")


def test_device_index_beyond_the_gpus():
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            TrainerOptions(device="cuda:0").validate()
        return
    count = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=f"has {count} GPU"):
        TrainerOptions(device=f"cuda:{count}").validate()


# -- interpolations ------------------------------------------------------------------


def test_an_interpolation_that_cannot_resolve(capsys, tmp_path):
    code, _, err = run_cli(capsys, "train", *TINY, "trainer.run_dir=${nope}")
    assert_clean(code, err, "trainer.run_dir: cannot resolve", "nope")
    code, _, err = run_cli(capsys, "train", *TINY, "trainer.run_dir=${oc.env:SLIPSTREAM_NO_SUCH}")
    assert_clean(code, err, "trainer.run_dir: cannot resolve", "SLIPSTREAM_NO_SUCH")
    # One that resolves is resolved in the config the run gets.
    assert build_config(None, None, ["trainer.seed=${data.batch_size}"]).trainer.seed == 128


# -- OSErrors on the run directory and output paths ----------------------------------


def test_run_dir_under_a_file_or_a_file(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = run_cli(capsys, "train", *TINY, f"trainer.run_dir={blocker / 'run'}")
    assert_clean(code, err, "which is a file")
    code, _, err = run_cli(capsys, "train", *TINY, f"trainer.run_dir={blocker}")
    assert_clean(code, err, "this is a file, not a directory")
    assert blocker.read_text() == "x"


def test_run_dir_in_a_read_only_place(tmp_path, monkeypatch):
    # Tests may run as root, who may write anywhere: the permission check is simulated.
    monkeypatch.setattr("slipstream.config.options.os.access", lambda *a: False)
    with pytest.raises(ConfigError, match="no write permission or a read-only file system"):
        check_output_dir(tmp_path / "new" / "run", "trainer.run_dir")


@pytest.mark.parametrize(
    "code, cause",
    [(errno.ENOSPC, "the disk is full"), (errno.EFBIG, "the file is too large")],
)
def test_a_write_failing_mid_run_names_the_cause(capsys, tmp_path, monkeypatch, code, cause):
    def full(payload, path):
        raise OSError(code, "os message", str(path))

    monkeypatch.setattr("slipstream.services.checkpointer.save_checkpoint", full)
    run_dir = tmp_path / "run"
    exit_code, _, err = run_cli(capsys, "train", *TINY, f"trainer.run_dir={run_dir}")
    # A run that began ends `failed`, with that status's exit code.
    assert_clean(exit_code, err, cause, str(run_dir / "checkpoints"), expected=1)
    # The run still recorded how it ended.
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"


def test_every_errno_reads_as_a_cause():
    for code, words in [
        (errno.EROFS, "read-only"),
        (errno.EACCES, "permission denied"),
        (errno.ENOTDIR, "is a file, not a directory"),
        (errno.EISDIR, "is a directory"),
    ]:
        message = describe_os_error(OSError(code, "x", "/some/path"))
        assert message.startswith("cannot use /some/path: ") and words in message


# -- no network ------------------------------------------------------------------------


def _offline(*args, **kwargs):
    raise urllib.error.URLError(OSError(errno.ENETUNREACH, "Network is unreachable"))


def test_pretrained_weights_without_network(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("timm.create_model", _offline)
    code, _, err = run_cli(
        capsys, "train", *TINY, "model.pretrained=true", f"trainer.run_dir={tmp_path / 'run'}"
    )
    assert_clean(code, err, "there is no network", "model.pretrained=false", "HF_HUB_OFFLINE")


def test_dataset_download_without_network(capsys, tmp_path, monkeypatch):
    import torchvision

    class OfflineCIFAR10(torchvision.datasets.CIFAR10):
        __init__ = _offline

    monkeypatch.setattr("torchvision.datasets.CIFAR10", OfflineCIFAR10)
    code, _, err = run_cli(
        capsys, "train", *TINY, "data.name=cifar10", f"data.root={tmp_path / 'data'}",
        "data.download=true", f"trainer.run_dir={tmp_path / 'run'}",
    )
    assert_clean(code, err, "cifar10: cannot download", "there is no network", "data.download=false")


# -- a resume that does not match -------------------------------------------------------


def test_resume_with_another_optimizer_says_what_wrote_the_checkpoint(tmp_path):
    first = train(tmp_path / "a", [], max_duration="1ba", eval_interval=None)
    latest = first.run_dir / "checkpoints" / "latest.pt"
    from helpers import tiny_loaders, tiny_model
    from slipstream import Trainer

    model = tiny_model()
    trainer = Trainer(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        train_data=tiny_loaders()[0],
        max_duration="2ba",
        run_dir=tmp_path / "b",
        device="cpu",
        load_path=latest,
        progress_bar=False,
        verbose=False,
    )
    with pytest.raises(CheckpointError, match="written by a run of model 'timm/test_resnet' with optimizer 'SGD'"):
        trainer.fit()
    # The same optimizer resumes (the check is not a refusal of every resume).
    train(tmp_path / "a", [], max_duration="2ba", eval_interval=None, load_path=latest)


# -- silent no-ops ------------------------------------------------------------------------


def _warnings_of(*args) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_config(*args)
    return [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


def test_removing_what_is_not_there():
    with pytest.raises(ConfigError, match="no algorithm 'emma' is installed.*did you mean 'ema'"):
        build_config("default", "no:emma")
    assert _warnings_of("default", "no:ema") == [
        "--algorithms no:ema removes nothing: 'ema' is not enabled "
        "(enabled: stepwise_lr, mixed_precision, channels_last)"
    ]
    assert _warnings_of("default", None, ["algorithms.ema=false"])[0].startswith(
        "algorithms.ema=false removes nothing"
    )
    # Removing an enabled one is silent, and so is the default recipe as it is.
    assert _warnings_of("default", "no:channels_last") == []
    assert _warnings_of("default") == []


def test_settings_the_run_ignores_are_named(capsys, tmp_path):
    assert _warnings_of(None, None, ["data.root=/data", "optimizer.betas=[0.5, 0.9]"]) == [
        "data.root is ignored with data.name=synthetic (only cifar10 and cifar100 and imagefolder read it)",
        "optimizer.betas is ignored with optimizer.name=sgd (only adamw and lamb read it)",
    ]
    assert _warnings_of(None, None, ["trainer.checkpoint_interval=null", "trainer.checkpoint_keep=5"])
    code, _, err = run_cli(
        capsys, "train", *TINY, "--algorithms", "no:ema", f"trainer.run_dir={tmp_path / 'r'}"
    )
    assert code == 0 and "slipstream: warning: --algorithms no:ema removes nothing" in err


def test_the_engines_own_warnings_are_one_line_each(capsys, tmp_path, monkeypatch):
    # An unwritable cache: the peak FLOP/s service warns from inside the engine's
    # package (slipstream/services/), not from the CLI's own folder.
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    code, _, err = run_cli(capsys, "train", *TINY, f"trainer.run_dir={tmp_path / 'r'}")
    assert code == 0, err
    assert "slipstream: warning: cannot cache the peak FLOP/s" in err, err
    assert "UserWarning" not in err and "warnings.warn" not in err and "peak_flops(" not in err, err


def test_a_plugins_warning_from_its_hook_is_one_line_too(capsys, tmp_path):
    """A plugin warns from its hook with stacklevel=2, which points into pluggy: shown as
    Python shows it, the line named pluggy's file and not what to look at."""
    code, _, err = run_cli(capsys, "train", *TINY, "--algorithms", "mixed_precision",
                           "algorithms.mixed_precision.dtype=fp16", f"trainer.run_dir={tmp_path / 'r'}")  # fmt: skip
    assert code == 0, err
    assert "slipstream: warning: mixed_precision: fp16 on CPU is usually far slower than fp32" in err, err
    assert "pluggy" not in err and "UserWarning" not in err, err


def test_a_plugins_warning_from_its_own_module_is_one_line_too(capsys):
    from slipstream.cli.main import _show_warning

    shown = []
    show = _show_warning(lambda *args, **kwargs: shown.append(args))
    show(UserWarning("torch_compile: compiling took 4.1 s"), UserWarning, "/site/slipstream_torch_compile.py", 276)
    assert capsys.readouterr().err == "slipstream: warning: torch_compile: compiling took 4.1 s\n"
    show(UserWarning("a library's"), UserWarning, "/site/somelib.py", 1)
    assert shown and capsys.readouterr().err == ""  # a library's warning as Python shows it


# -- a plugin that exits at import ----------------------------------------------------------


def test_a_plugin_calling_sys_exit_at_import(capsys, tmp_path, monkeypatch):
    site = fake_distribution(
        tmp_path / "site", "slipstream-quitter", {"quitter": "quitter_mod:Quitter"},
        {"quitter_mod": "import sys\nsys.exit(3)\n"},
    )
    monkeypatch.syspath_prepend(str(site))
    code, out, _ = run_cli(capsys, "algorithms")  # metadata only: the module is not run
    assert code == 0 and "quitter" in out and "FAILED" not in out
    code, out, _ = run_cli(capsys, "algorithms", "--check")
    assert code == 1
    assert "quitter" in out and "FAILED TO LOAD: its import called sys.exit(3)" in out
    assert "channels_last" in out  # the others are still listed
    code, _, err = run_cli(capsys, "train", *TINY, "--algorithms", "quitter")
    assert_clean(code, err, "slipstream-quitter", "sys.exit(3)")
    sys.modules.pop("quitter_mod", None)


# -- the command line itself ------------------------------------------------------------------


def test_options_and_overrides_in_any_order(capsys, tmp_path):
    run_dir = tmp_path / "run"
    code, out, err = run_cli(
        capsys, "train", "trainer.seed=7", "-q", *TINY[:-1], f"trainer.run_dir={run_dir}"
    )
    assert code == 0, err
    assert "run directory" not in out  # -q took effect although it came between overrides
    config = (run_dir / "config.yaml").read_text()
    assert "seed: 7" in config and "max_duration: 1ba" in config
    with pytest.raises(SystemExit) as exited:  # argparse's own usage error
        main(["train", "trainer.seed=7", "--no-such-option"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


def test_under_torchrun_only_rank_0_prints_a_user_error(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    code, out, err = run_cli(capsys, "train", "data.batchsize=3")
    assert code == 2 and out == "" and err == ""
    monkeypatch.setenv("RANK", "0")
    code, _, err = run_cli(capsys, "train", "data.batchsize=3")
    assert_clean(code, err, "unknown key 'data.batchsize'")


def test_a_bug_still_shows_its_traceback(capsys, monkeypatch):
    # Only errors a user can act on become one line; a bug must stay visible.
    def broken(*args, **kwargs):
        raise AttributeError("a bug")

    monkeypatch.setattr("slipstream.config.schema.build_run", broken)
    with pytest.raises(AttributeError, match="a bug"):
        main(["train"])


def _tiny_image_folder(root: Path, bad: dict[str, bytes]) -> None:
    colour_image_folder(root, {"red": (255, 0, 0), "blue": (0, 0, 255)})
    for name, data in bad.items():
        (root / "train" / "red" / name).write_bytes(data)


def test_unreadable_images_are_skipped_with_a_warning(tmp_path, capsys, monkeypatch):
    from PIL import Image

    from slipstream.data import DataError, build_datasets, decode

    _tiny_image_folder(tmp_path, {"0_bad.png": b"not an image", "1_bad.png": b"\x89PNG broken"})
    train_set, _, _ = build_datasets("imagefolder", root=tmp_path, image_size=8)
    paths = [Path(p).name for p, _ in train_set.samples]
    red = train_set.class_to_idx["red"]
    bad = [i for i, (p, _) in enumerate(train_set.samples) if "red" in p and "bad" in p]
    first, last = bad[0], bad[-1]
    image, label = train_set[first]  # replaced by the next readable image of its class...
    assert paths[first + 1] == "1.png"
    assert torch.equal(image, train_set[first + 1][0]) and label == red
    image, label = train_set[last]  # the class's last item: wraps round to its first, not to the next class
    red_first = train_set.targets.index(red)  # its 0.png
    assert label == red and torch.equal(image, train_set[red_first][0])
    train_set[first]  # read again (a later epoch): named once
    err = capsys.readouterr().err
    assert err.count("skipping unreadable image") == 2 and "0_bad.png" in err and "1_bad.png" in err
    # ...named up to a cap, and a class with nothing readable is an error.
    monkeypatch.setattr(decode, "MAX_NAMED", 1)
    train_set.skipped.clear()
    train_set[first]
    train_set[last]
    err = capsys.readouterr().err
    assert err.count("skipping unreadable image") == 1 and "further ones are skipped" in err
    green = tmp_path / "train" / "green"
    green.mkdir()
    for name in ("0.png", "1.png"):
        (green / name).write_bytes(b"not an image")
    (tmp_path / "val" / "green").mkdir()
    Image.new("RGB", (8, 8), (0, 255, 0)).save(tmp_path / "val" / "green" / "0.png")
    train_set, _, _ = build_datasets("imagefolder", root=tmp_path, image_size=8)
    with pytest.raises(DataError, match="none of the 2 images of class 'green'"):
        train_set[train_set.targets.index(train_set.class_to_idx["green"])]
