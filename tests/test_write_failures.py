"""A write of the run that fails (a file-size limit, a full disk, no permission) ends
the run `failed` with one line naming the file and the cause, whatever torch raised,
and never leaves a checkpoint truncated or replaced by the failed write."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import TINY_RUN, error_lines
from slipstream import load_checkpoint
from slipstream.cli.main import main
from slipstream.run.checkpoint import save_shards
from slipstream.run.directory import atomic_write, write_failure

TINY = [*TINY_RUN, "--quiet"]


def assert_failed_in_one_line(code: int, err: str, *fragments: str) -> None:
    assert code == 1, err  # the exit code of status `failed`
    assert "Traceback" not in err
    errors = error_lines(err)
    assert len(errors) == 1 and errors[0].startswith("slipstream: error: "), err
    for fragment in fragments:
        assert fragment in errors[0], err


def leftovers(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.endswith(".tmp"))


# The limit is set (soft, so it can be lifted again) just before the chosen file is
# written, so that the other files of the run are written as usual; SIGXFSZ ignored,
# as Python does by default, so that the write fails with EFBIG instead of killing.
LIMITED = textwrap.dedent(
    """
    import contextlib, io, json, resource, signal, sys
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    import slipstream.services.checkpointer as service
    from slipstream.cli.main import main

    save, limited, seen = service.save_checkpoint, [None], {}
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]

    def save_under_limit(payload, path):
        seen[path.name] = seen.get(path.name, 0) + 1
        if f"{path.name}#{seen[path.name]}" == limited[0]:
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # 1 MiB; checkpoints are ~4.5
        try:
            return save(payload, path)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))

    service.save_checkpoint = save_under_limit
    results = []
    for name, args in json.loads(sys.argv[1]):
        limited[0] = name
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(args)
        results.append({"code": code, "err": err.getvalue()})
    print(json.dumps(results))
    """
)


def test_a_file_size_limit_on_best_and_latest_is_one_line_and_keeps_the_last_good_files(tmp_path):
    best_run, every_batch = tmp_path / "best", tmp_path / "every_batch"
    latest = every_batch / "checkpoints" / "latest.pt"
    runs = [
        # best.pt, written at the final evaluation, hits the limit (torch's zip writer
        # raises "RuntimeError: [enforce fail at inline_container.cc] unexpected pos").
        ("best.pt#1", ["train", *TINY, "trainer.max_duration=1ba", f"trainer.run_dir={best_run}"]),
        # A checkpoint every batch: the second latest.pt hits the limit.
        ("latest.pt#2", ["train", *TINY, "trainer.max_duration=2ba", "trainer.best_metric=null",
                         "trainer.checkpoint_interval=1ba", f"trainer.run_dir={every_batch}"]),
    ]
    done = subprocess.run(
        [sys.executable, "-c", LIMITED, json.dumps(runs)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    best, second = json.loads(done.stdout.strip().splitlines()[-1])
    size_limit = "the file is too large for this file system or the file-size limit (ulimit -f)"
    assert_failed_in_one_line(best["code"], best["err"], f"{best_run / 'checkpoints' / 'best.pt'}: {size_limit}")
    assert not (best_run / "checkpoints" / "best.pt").exists() and not leftovers(best_run)
    assert json.loads((best_run / "summary.json").read_text())["status"] == "failed"
    assert_failed_in_one_line(second["code"], second["err"], f"{latest}: {size_limit}")
    # The failed write replaced nothing: latest.pt is still the one of batch 1, whole.
    assert load_checkpoint(latest)["timestamp"]["batch"] == 1 and not leftovers(every_batch)


@contextmanager
def disk_fills_after(limit: int):
    """Files opened by the run's atomic writes take ``limit`` bytes, then the disk is full."""

    class Filling:
        def __init__(self, file):
            self.file, self.left = file, limit

        def write(self, data):
            size = memoryview(data).nbytes
            if size > self.left:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.left -= size
            return self.file.write(data)

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    real = os.fdopen
    yield lambda fd, *a, **k: Filling(real(fd, *a, **k))


def test_a_full_disk_mid_checkpoint_is_one_line_and_leaves_no_partial_file(capsys, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    with disk_fills_after(1 << 20) as fdopen:
        monkeypatch.setattr("slipstream.run.directory.os.fdopen", fdopen)
        code = main(["train", *TINY, "trainer.max_duration=1ba", f"trainer.run_dir={run_dir}"])
    err = capsys.readouterr().err
    assert_failed_in_one_line(code, err, f"{run_dir / 'checkpoints' / 'best.pt'}: the disk is full")
    assert not leftovers(run_dir) and not (run_dir / "checkpoints" / "best.pt").exists()


@pytest.mark.parametrize(
    "code, cause", [(errno.EACCES, "permission denied"), (errno.EROFS, "the file system is read-only")]
)
def test_no_permission_or_a_read_only_file_system_is_one_line(capsys, tmp_path, monkeypatch, code, cause):
    # Tests may run as root, who may write anywhere: the refusal is simulated where
    # the checkpoint's temporary file is created.
    real = os.open

    def refuse(path, *args, **kwargs):
        if str(path).endswith(".tmp") and Path(path).parent.name == "checkpoints":
            raise OSError(code, os.strerror(code), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr("slipstream.run.directory.os.open", refuse)
    run_dir = tmp_path / "run"
    exit_code = main(["train", *TINY, "trainer.max_duration=1ba", f"trainer.run_dir={run_dir}"])
    err = capsys.readouterr().err
    # Named by the checkpoint, not by the temporary file it was being written through.
    assert_failed_in_one_line(exit_code, err, f"cannot use {run_dir / 'checkpoints' / 'best.pt'}: {cause}")
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"


def test_a_writer_error_without_an_os_error_is_read_off_the_file_system(tmp_path, monkeypatch):
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr("slipstream.run.directory.os.statvfs", lambda p: SimpleNamespace(f_bavail=0))
    found = write_failure(short, tmp_path / "latest.pt")
    assert found.errno == errno.ENOSPC and found.filename == str(tmp_path / "latest.pt")
    monkeypatch.setattr("slipstream.run.directory.os.statvfs", lambda p: SimpleNamespace(f_bavail=10**6))
    assert write_failure(short, tmp_path / "latest.pt") is None

    def bug(f):
        raise RuntimeError("a bug in a payload")

    # An error that is no write failure stays itself (a bug's traceback is its report).
    with pytest.raises(RuntimeError, match="a bug in a payload"):
        atomic_write(tmp_path / "x.pt", bug)
    assert list(tmp_path.iterdir()) == []


def test_sharded_checkpoint_shards_fail_in_one_line_and_keep_the_old_folder(tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as dcp_fs

    folder = tmp_path / "ep1-ba4.dcp"
    save_shards({"model": {"w": torch.zeros(1000)}}, folder)
    before = sorted(p.name for p in folder.iterdir())

    @contextmanager
    def full(self, path, mode):
        with disk_fills_after(100) as fdopen, Path(path).open(mode) as f:
            yield fdopen(os.dup(f.fileno()), mode)

    monkeypatch.setattr(dcp_fs.FileSystem, "create_stream", full)
    with pytest.raises(OSError) as failed:
        save_shards({"model": {"w": torch.ones(1000)}}, folder)
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(folder)
    assert sorted(p.name for p in folder.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]  # no partial folder left


def test_a_full_disk_under_the_metrics_log_names_the_log(capsys, tmp_path, monkeypatch):
    # metrics.jsonl is appended to, not replaced: a file object's OSError names no
    # file, so the log names itself.
    import slipstream.services.metrics as metrics

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def close(self):
            pass

    opened = metrics.MetricsLogger.fit_start

    def fit_start(self, state):
        opened(self, state)
        if self._file is not None:
            self._file.close()
            self._file = Full()

    fit_start.slipstream_impl = opened.slipstream_impl  # still the hook implementation
    monkeypatch.setattr(metrics.MetricsLogger, "fit_start", fit_start)
    monkeypatch.setattr(metrics, "FLUSH_S", 0.0)
    run_dir = tmp_path / "run"
    code = main(["train", *TINY, "trainer.max_duration=1ba", "trainer.log_interval=1", f"trainer.run_dir={run_dir}"])
    err = capsys.readouterr().err
    assert_failed_in_one_line(code, err, f"cannot use {run_dir / 'metrics.jsonl'}: the disk is full")


# -- export (issue 44, case 7) ----------------------------------------------------------------

EXPORT_FORMATS = [("torchscript", ".pt"), ("exported-program", ".pt2")]


def _export_tiny(fmt: str, out: Path):
    from helpers import tiny_model
    from slipstream.run.inference import export_model

    return export_model(tiny_model(), torch.rand(2, 3, 16, 16), fmt, out, check=False)


@pytest.mark.parametrize("fmt, suffix", EXPORT_FORMATS)
@pytest.mark.parametrize(
    "code, cause",
    [(errno.EROFS, "the file system is read-only"), (errno.EACCES, "permission denied"),
     (errno.ENOSPC, "the disk is full")],
)
def test_issue_44_case_7_an_export_the_file_system_refuses_is_one_line_naming_the_file(
    tmp_path, monkeypatch, fmt, suffix, code, cause
):
    """Issue 44, case 7: a read-only file system (or no permission, or no room) under
    `export -o` was torch's C++ error, or a line naming the hidden partial file; now one
    line naming the file asked for, and nothing is left behind."""
    from slipstream.cli.main import user_error_message

    real = os.open

    def refuse(path, *args, **kwargs):
        if ".partial" in str(path):
            raise OSError(code, os.strerror(code), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr("slipstream.run.inference.os.open", refuse)
    out = tmp_path / f"model{suffix}"
    with pytest.raises(OSError) as failed:
        _export_tiny(fmt, out)
    assert user_error_message(failed.value) == f"cannot use {out}: {cause}"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt, suffix", EXPORT_FORMATS)
def test_issue_44_case_7_a_full_disk_under_torchs_writer_is_an_error_not_an_abort(
    tmp_path, monkeypatch, fmt, suffix
):
    """Issue 44, case 7: torch's C++ writer, given a path, aborted the process on a full
    disk (`terminate called after throwing an instance of 'c10::Error'`, exit 134) and
    left a partial file. The file is now written through a Python file object, whose
    failed write (the disk full after 4 KiB here) is one line naming the file asked for."""
    import io

    from slipstream.cli.main import user_error_message

    class Filling(io.FileIO):
        left = 4096

        def write(self, data):
            size = memoryview(data).nbytes
            if size > Filling.left:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            Filling.left -= size
            return super().write(data)

    monkeypatch.setattr("slipstream.run.inference.io.FileIO", Filling)
    out = tmp_path / f"model{suffix}"
    with pytest.raises(OSError) as failed:
        _export_tiny(fmt, out)
    assert user_error_message(failed.value) == f"cannot use {out}: the disk is full"
    assert list(tmp_path.iterdir()) == []


def test_issue_44_case_7_a_directory_or_a_read_only_folder_as_the_export_file_is_one_line(tmp_path, monkeypatch):
    """Issue 44, case 7: the Python API's export to a directory, or one whose partial
    file cannot even be removed (the file system turned read-only), names the file asked
    for, not the partial one."""
    from slipstream.cli.main import user_error_message

    with pytest.raises(OSError) as failed:
        _export_tiny("torchscript", tmp_path)
    assert user_error_message(failed.value) == f"cannot use {tmp_path}: it is a directory, not a file"
    out = tmp_path / "m.pt"
    real_unlink = Path.unlink

    def read_only(self, *args, **kwargs):
        if ".partial" in self.name:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_unlink(self, *args, **kwargs)

    def replace(src, dst):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(src), str(dst))

    monkeypatch.setattr(Path, "unlink", read_only)
    monkeypatch.setattr("slipstream.run.inference.os.replace", replace)
    with pytest.raises(OSError) as failed:
        _export_tiny("torchscript", out)
    assert user_error_message(failed.value) == f"cannot use {out}: the file system is read-only"


def test_issue_44_case_7_an_onnx_export_that_fails_names_its_file(tmp_path, monkeypatch):
    """Issue 44, case 7: ONNX said "cannot use a file of the run" and left a truncated
    .onnx; now the .onnx asked for is named and no file is left."""
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
    pytest.importorskip("onnxscript", reason="the onnx extra is not installed")
    from slipstream.cli.main import user_error_message
    from slipstream.run import inference

    def full(model, inputs, output, classes):
        Path(output).write_bytes(b"half an onnx file")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a file object's write: no name

    monkeypatch.setattr(inference, "_export_onnx", full)
    out = tmp_path / "m.onnx"
    with pytest.raises(OSError) as failed:
        _export_tiny("onnx", out)
    assert user_error_message(failed.value) == f"cannot use {out}: the disk is full"
    assert list(tmp_path.iterdir()) == []
