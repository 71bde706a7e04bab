"""The run-directory contract: every file a run writes, where, and how.

::

    RUN_DIR/config.yaml            the resolved config
    RUN_DIR/metrics.jsonl          one JSON record per logged step or evaluation
    RUN_DIR/summary.json           the run's outcome
    RUN_DIR/eval/{metric}-ba{B}.json  a table metric's value at each evaluation
                                   (confusion_matrix), at global batch B
    RUN_DIR/checkpoints/latest.pt  the newest checkpoint
    RUN_DIR/checkpoints/best.pt    the checkpoint with the best accuracy
    RUN_DIR/checkpoints/ep{E}-ba{B}.pt  interval checkpoints
    RUN_DIR/checkpoints/ep{E}-ba{B}.dcp/  torch.distributed.checkpoint shards of the model
                                   and optimizer of that checkpoint (sharded checkpoints
                                   only; its .pt file and latest.pt name the folder)

Every writer and every reader takes its paths from here, so that clearing a run
(``trainer.overwrite=true``) removes exactly the files a run owns and never a
user's own files that happen to sit in the same directory. Files are replaced
atomically and durably (temporary file, fsync, rename, fsync of the directory),
with the permissions the user's umask gives any new file.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import secrets
import shutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import yaml

from slipstream.errors import ConfigError, exception_chain

# libyaml's emitter where PyYAML has it: the same YAML at a quarter of the cost,
# which a short run pays at its start.
YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
CHECKPOINTS = "checkpoints"
LATEST = "latest.pt"
BEST = "best.pt"
EVAL_TABLES = "eval"

_INTERVAL_CHECKPOINT = re.compile(r"ep\d+-ba(\d+)\.pt")  # the step captured
_EVAL_TABLE = re.compile(r"[A-Za-z0-9_.]+-ba\d+\.json")
_SHARDS = re.compile(r"ep\d+-ba\d+\.dcp")
# Shard folders of save_shards on their way in or out (a crash may leave one).
_SHARDS_TEMPORARY = re.compile(r"\.ep\d+-ba\d+\.dcp\.(partial|old)")
# Temporary files of atomic_write: ".{name}.{token}.tmp".
_TEMPORARY = re.compile(r"\..+\.[0-9a-f]{16}\.tmp")


def checkpoint_name(epoch: int, batch: int) -> str:
    """The file name of the interval checkpoint at ``epoch`` and global ``batch``.

    >>> checkpoint_name(2, 40)
    'ep2-ba40.pt'
    """
    return f"ep{epoch}-ba{batch}.pt"


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory (nothing is created until a writer writes)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    @property
    def latest(self) -> Path:
        return self.checkpoints / LATEST

    @property
    def best(self) -> Path:
        return self.checkpoints / BEST

    def checkpoint(self, epoch: int, batch: int) -> Path:
        return self.checkpoints / checkpoint_name(epoch, batch)

    @property
    def eval_tables(self) -> Path:
        return self.root / EVAL_TABLES

    def eval_table(self, metric: str, batch: int) -> Path:
        """The file of a table metric's value (a confusion matrix) at global ``batch``."""
        return self.eval_tables / f"{metric}-ba{batch}.json"

    def shards(self, epoch: int, batch: int) -> Path:
        """The folder of torch.distributed.checkpoint shards of a sharded checkpoint."""
        return self.checkpoints / f"ep{epoch}-ba{batch}.dcp"

    def shards_of(self, checkpoint: Path) -> Path:
        """The shard folder beside the interval checkpoint file ``checkpoint``."""
        return checkpoint.with_suffix(".dcp")

    def shard_folders(self) -> list[Path]:
        if not self.checkpoints.is_dir():
            return []
        return sorted(
            p for p in self.checkpoints.iterdir() if p.is_dir() and _SHARDS.fullmatch(p.name)
        )

    def interval_checkpoints(self) -> list[tuple[int, Path]]:
        """The interval checkpoint files that exist, as (step, path), oldest first."""
        if not self.checkpoints.is_dir():
            return []
        found = (
            (match, p) for p in self.checkpoints.iterdir() if (match := _INTERVAL_CHECKPOINT.fullmatch(p.name))
        )
        return sorted((int(match.group(1)), p) for match, p in found if p.is_file())

    def checkpoint_files(self) -> list[Path]:
        """The checkpoints of the contract that exist (latest, best, interval ones)."""
        if not self.checkpoints.is_dir():
            return []
        return sorted(
            p
            for p in self.checkpoints.iterdir()
            if p.is_file() and (p.name in (LATEST, BEST) or _INTERVAL_CHECKPOINT.fullmatch(p.name))
        )

    def run_files(self) -> list[Path]:
        """Every file of the contract that exists here, temporary files included."""
        files = [p for p in (self.config, self.metrics, self.summary) if p.is_file()]
        files += self.checkpoint_files()
        if self.eval_tables.is_dir():
            files += [p for p in self.eval_tables.iterdir() if p.is_file() and _EVAL_TABLE.fullmatch(p.name)]
        for folder in (self.root, self.checkpoints, self.eval_tables):
            if folder.is_dir():
                files += [p for p in folder.iterdir() if _TEMPORARY.fullmatch(p.name)]
        return files

    def ended_as(self) -> str | None:
        """The status summary.json gives a run that reached its end (completed,
        target_reached, stopped_early, diverged), or None: no summary, or one of a run
        that was interrupted or failed and may go on."""
        try:
            status = json.loads(self.summary.read_text()).get("status")
        except (OSError, ValueError, AttributeError):
            return None
        return status if status not in (None, "interrupted", "failed") else None

    def holds_run(self) -> list[str]:
        """What makes this directory worth protecting: names of the checkpoints and
        of a non-empty metrics log. A start that failed before its first record
        leaves neither, so its leftovers never block the retry."""
        held = [str(p.relative_to(self.root)) for p in self.checkpoint_files()]
        held += [str(p.relative_to(self.root)) for p in self.shard_folders()]
        if self.metrics.is_file() and self.metrics.stat().st_size > 0:
            held.insert(0, METRICS)
        return held

    def clear(self, plugin_files: Iterable[str] = ()) -> list[Path]:
        """Delete the files of the contract (and an emptied checkpoints folder),
        and ``plugin_files``: names directly under the directory that plugins
        declare as theirs (:attr:`slipstream.Plugin.run_files`); anything else in the
        directory is left alone. Returns what was deleted."""
        removed = self.run_files()
        for path in removed:
            path.unlink(missing_ok=True)
        for name in sorted(set(plugin_files)):
            path = self.root / name
            if Path(name).name != name or name in ("", ".", ".."):
                continue  # only a plain name under the run directory, never above it
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            elif path.exists() or path.is_symlink():
                path.unlink(missing_ok=True)
                removed.append(path)
        temporary = [
            p for p in (self.checkpoints.iterdir() if self.checkpoints.is_dir() else ())
            if p.is_dir() and _SHARDS_TEMPORARY.fullmatch(p.name)
        ]
        for folder in [*self.shard_folders(), *temporary]:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        for folder in (self.checkpoints, self.eval_tables):
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        if removed:
            fsync_dir(self.root)
        return removed


def new_run_dir(label: str = "run", parent: str | Path = "runs") -> Path:
    """A fresh ``parent/label-YYYYmmdd-HHMMSS`` path (suffixed -2, -3, ... if taken)."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = Path(parent) / f"{label}-{stamp}", 1
    while path.exists():
        n += 1
        path = Path(parent) / f"{label}-{stamp}-{n}"
    return path


# --------------------------------------------------------------------------- policy


def resumes_in(paths: RunDir, load_path: Path | None) -> bool:
    """Whether a run resuming from ``load_path`` continues the one in ``paths``
    (its checkpoint is in there)."""
    return load_path is not None and paths.root.resolve() in load_path.resolve().parents


def choose_run_dir(
    run_dir: str | Path | None, *, overwrite: bool, load_path: Path | None, weights_from: Path | None = None
) -> RunDir:
    """The run directory a new run may use: ``run_dir`` (a fresh one under runs/
    when None), refused when it holds another run that neither ``overwrite`` nor a
    resume from it allows replacing, or when ``overwrite`` would delete the checkpoint
    a fine-tuning run loads (``weights_from``). Nothing is written."""
    paths = RunDir(Path(run_dir) if run_dir is not None else new_run_dir("run"))
    held = paths.holds_run()
    deleted = weights_from is not None and paths.checkpoints.resolve() in weights_from.resolve().parents
    if overwrite and deleted and weights_from.is_file():
        raise ConfigError(
            f"trainer.overwrite=true would delete {weights_from}, the checkpoint this run loads its "
            f"weights from; copy it out of {paths.root} first, or choose another trainer.run_dir"
        )
    resuming_here = resumes_in(paths, load_path)
    if resuming_here and overwrite:
        raise ConfigError(
            f"trainer.overwrite=true would delete {load_path}, the checkpoint this run "
            f"resumes from; drop trainer.overwrite to continue the run in {paths.root}, "
            "or choose another trainer.run_dir"
        )
    if held and not (overwrite or resuming_here):
        resume = (
            f"resume it with trainer.load_path={paths.latest}, " if paths.latest.is_file() else ""
        )
        raise ConfigError(
            f"run directory {paths.root} already holds a run ({', '.join(held[:3])}); "
            f"choose another trainer.run_dir, {resume}or set trainer.overwrite=true"
        )
    return paths


def prepare_run_dir(
    paths: RunDir,
    *,
    overwrite: bool,
    load_path: Path | None,
    config: dict[str, Any] | None,
    verbose: bool = False,
    plugin_files: Iterable[str] = (),
) -> None:
    """Make the run directory this run's alone, once set-up has succeeded (so a
    start that fails leaves an earlier run intact): overwrite clears the files of
    the contract, and so does a retry after a start that failed before writing any
    record or checkpoint. A resumed run keeps its files. Writes config.yaml.
    ``plugin_files``: what plugins write under the run directory, cleared too."""
    if not resumes_in(paths, load_path) and (overwrite or not paths.holds_run()):
        removed = paths.clear(plugin_files)
        if removed and verbose and overwrite:
            print(
                f"slipstream: trainer.overwrite: removed {len(removed)} files of the "
                f"previous run in {paths.root}",
                file=sys.stderr,
            )
    paths.root.mkdir(parents=True, exist_ok=True)
    if config:
        atomic_write_text(paths.config, yaml.dump(config, Dumper=YAML_DUMPER, sort_keys=False))


# --------------------------------------------------------------------------- writing


def fsync_dir(folder: str | Path) -> None:
    """Make a rename or deletion in ``folder`` durable (where the OS allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # Windows cannot open a directory; renames there are durable enough
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory
        pass
    finally:
        os.close(fd)


class _RecordingFile:
    """A file that remembers the OSError its ``write`` raised. torch's zip writer
    turns a failed write into ``RuntimeError: [enforce fail at inline_container.cc]
    unexpected pos``, which names no cause; the error recorded here does."""

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


def _file_size_limit() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def write_failure(exc: BaseException, path: str | Path, written: int | None = None) -> OSError | None:
    """The OSError that made a write of ``path`` fail, named for ``path``: one
    raised or recorded in ``exc``'s chain (a library may wrap it in an error of its
    own), else the cause read off the file system when ``exc`` is a RuntimeError
    (torch's writers raise one on a short write): no free space left, or
    ``written`` bytes at the file-size limit (``ulimit -f``). None when ``exc`` is
    no write failure (a bug, a bad payload)."""
    found: OSError | None = None
    for link in exception_chain(exc):
        if isinstance(link, OSError) and link.errno is not None:
            found = link
            break
    if found is None and isinstance(exc, RuntimeError):
        limit = _file_size_limit()
        if limit is not None and written is not None and written >= limit:
            found = OSError(errno.EFBIG, os.strerror(errno.EFBIG))
        else:
            try:
                stat = os.statvfs(Path(path).parent)
                if stat.f_bavail == 0:
                    found = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            except (OSError, AttributeError):
                pass
    if found is None:
        return None
    return OSError(found.errno, found.strerror or os.strerror(found.errno), str(path))


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], Any]) -> Path:
    """Write ``path`` through ``write(file)`` so that a crash at any moment leaves
    either the old file or the new one, never a truncated one.

    Unlike ``tempfile.mkstemp`` (mode 0600) the file is created with mode 0666
    minus the umask, as ``open()`` would, so checkpoints get the same permissions
    as every other file of the run.

    A write that fails for want of room, permission or size raises an OSError that
    names ``path`` (not the temporary file) and the cause, whatever the writer
    raised (see :func:`write_failure`); the old file is left as it was.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise (write_failure(exc, path) or exc) from None
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(tmp, flags, 0o666)
            break
        except FileExistsError:
            continue
        except OSError as exc:
            raise (write_failure(exc, path) or exc) from None
    recording: _RecordingFile | None = None
    try:
        with os.fdopen(fd, "wb") as f:
            recording = _RecordingFile(f)
            write(recording)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as exc:
        written = _size(tmp)
        tmp.unlink(missing_ok=True)
        recorded = recording.error if recording is not None else None
        failure = write_failure(recorded or exc, path, written)
        if failure is None:
            raise
        raise failure from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")))


# --------------------------------------------------------------------------- strict JSON


def finite_json(value: Any, _path: str = "", _found: list[str] | None = None) -> tuple[Any, list[str]]:
    """``value`` with every NaN or infinity replaced by None, and the dotted keys
    where that happened, so that ``json.dumps(..., allow_nan=False)`` accepts it.

    >>> finite_json({"loss": float("nan"), "lr": 0.1, "sizes": [1.0, float("inf")]})
    ({'loss': None, 'lr': 0.1, 'sizes': [1.0, None]}, ['loss', 'sizes.1'])
    """
    found = [] if _found is None else _found
    if isinstance(value, float) and not math.isfinite(value):
        found.append(_path)
        return None, found
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out[key] = finite_json(item, f"{_path}.{key}" if _path else str(key), found)[0]
        return out, found
    if isinstance(value, (list, tuple)):
        items = [
            finite_json(item, f"{_path}.{i}" if _path else str(i), found)[0]
            for i, item in enumerate(value)
        ]
        return items, found
    return value, found


def strict_json(value: dict[str, Any], **options: Any) -> str:
    """``value`` as strict JSON (no NaN, no Infinity): non-finite numbers become
    null and a ``"nonfinite"`` field lists the keys that held them.

    >>> strict_json({"step": 3, "loss": float("nan")})
    '{"step": 3, "loss": null, "nonfinite": ["loss"]}'
    """
    # default=str keeps odd values (a dtype, a path) readable instead of failing the write.
    try:  # the common case, all finite: no walk over the record first
        return json.dumps(value, allow_nan=False, default=str, **options)
    except ValueError:
        pass
    clean, bad = finite_json(value)
    if bad:
        clean["nonfinite"] = bad
    return json.dumps(clean, allow_nan=False, default=str, **options)
