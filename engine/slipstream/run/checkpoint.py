"""Checkpoint files: what they hold, written atomically, read with a clear error.

A checkpoint is a plain dict that ``torch.load(path, weights_only=True)`` reads:
the unwrapped model's ``state_dict``, the optimizer's, every scheduler's, every
plugin's state under its registered name (with version and config), the
timestamp, the random number generators and the resolved config. Together with
the seed-and-epoch data order, that is what a bit-exact resume needs.

:func:`checkpoint_payload` builds that dict from a run's :class:`State`;
:func:`restore_checkpoint` puts one back into a run, or says in one line why it
does not fit (naming the model and optimizer that wrote it).
"""

from __future__ import annotations

import fnmatch
import os
import random
import shutil
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slipstream.config.options import KEYWORD_MAPPINGS, plain
from slipstream.data.sources import data_locations
from slipstream.errors import CheckpointError, ConfigError, describe
from slipstream.run.directory import LATEST, RunDir, atomic_write, fsync_dir, write_failure
from slipstream.run.versions import library_versions
from slipstream.state import State

FORMAT = "slipstream.checkpoint"
FORMAT_VERSION = 1
# The tag written from 2026-11-26 15:35 to 2026-11-27 (8a4d133..), when the engine's
# regrouping renamed the module and the tag with it; read as FORMAT.
_FORMAT_ALIASES = frozenset({FORMAT, "slipstream.run.checkpoint"})


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _to_lists(random.getstate())}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    # The generators take their states as CPU byte tensors only, and a checkpoint
    # loaded onto the run's device (map_location) brings them there.
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(_to_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def _to_lists(value: Any) -> Any:
    return [_to_lists(v) for v in value] if isinstance(value, (tuple, list)) else value


def _to_tuples(value: Any) -> Any:
    return tuple(_to_tuples(v) for v in value) if isinstance(value, list) else value


def save_checkpoint(payload: dict[str, Any], path: str | Path) -> Path:
    """Write ``payload`` to ``path`` atomically and durably: a crash mid-write
    leaves the previous file intact, never a truncated one."""
    tagged = {"format": FORMAT, "format_version": FORMAT_VERSION, **payload}
    return atomic_write(path, lambda f: torch.save(tagged, f))


def nonfinite_tensors(tensors: Mapping[str, Any]) -> list[str]:
    """Names of the floating-point tensors in ``tensors`` (a state_dict) that hold
    a NaN or an infinity. One device sync in all, so call it per checkpoint, not
    per step."""
    names = [
        name
        for name, t in tensors.items()
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
    ]
    if not names:
        return []
    finite = torch.stack([tensors[n].isfinite().all() for n in names]).cpu()
    return [n for n, ok in zip(names, finite.tolist(), strict=True) if not ok]


def sharded_parts(state_dicts: Mapping[str, Any]) -> list[str]:
    """The keys of ``state_dicts`` ({"model": ..., "optimizer": ...}) whose tensors
    are ``DTensor`` shards: what goes to torch.distributed.checkpoint, not the file."""
    from torch.distributed.tensor import DTensor

    def holds_shards(value: Any) -> bool:
        if isinstance(value, DTensor):
            return True
        if isinstance(value, Mapping):
            return any(holds_shards(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return any(holds_shards(v) for v in value)
        return False

    return [key for key, value in state_dicts.items() if holds_shards(value)]


def local_tensors(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` with each DTensor replaced by this rank's shard (flattened one
    level for an optimizer's per-parameter state), for checks that need no collective."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    for name, value in state_dict.items():
        if isinstance(value, Mapping):
            out.update({f"{name}.{k}": v for k, v in local_tensors(value).items()})
        else:
            out[name] = value.to_local() if isinstance(value, DTensor) else value
    return out


def save_shards(state_dicts: dict[str, Any], folder: Path) -> None:
    """Write ``state_dicts`` with torch.distributed.checkpoint (every rank writes its
    own shards; a collective). The shards go to a partial folder that replaces
    ``folder`` only once every rank has written (so an older folder of that name is
    replaced whole, and a failed write leaves it as it was); a failed write raises an
    OSError naming ``folder`` and the cause, on every rank."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    folder = Path(folder)
    partial = folder.with_name(f".{folder.name}.partial")
    writer = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    try:
        dcp.save(state_dicts, checkpoint_id=str(partial))
    except CheckpointException as exc:  # a BaseException: it would escape every handler
        if writer:
            shutil.rmtree(partial, ignore_errors=True)
        failures = [failure[0] for failure in exc.failures.values()]
        causes = [write_failure(f, folder) for f in failures]
        cause = next((c for c in causes if c is not None), None)
        if cause is not None:
            raise cause from None
        detail = describe(failures[0]) if failures else describe(exc)
        raise CheckpointError(f"cannot write the shards of {folder}: {detail}") from None
    if writer:
        # dcp.save returns on rank 0 after every rank wrote (its metadata is last).
        old = folder.with_name(f".{folder.name}.old")
        if folder.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(folder, old)
        os.replace(partial, folder)
        shutil.rmtree(old, ignore_errors=True)
        fsync_dir(folder.parent)


def load_shards(template: dict[str, Any], path: Path, payload: Mapping[str, Any]) -> dict[str, Any]:
    """Read the shards that checkpoint ``path`` names into ``template`` (the state
    dicts of this run, sharded as this run shards them; torch.distributed.checkpoint
    reshards to another world size) and return it."""
    import torch.distributed.checkpoint as dcp

    folder = Path(path).parent / payload["shards"]
    if not folder.is_dir():
        raise CheckpointError(
            f"checkpoint {path} keeps its model and optimizer in {folder}, which does not exist"
        )
    parts = {key: template[key] for key in payload.get("sharded_parts", ("model", "optimizer"))}
    if sorted(sharded_parts(parts)) != sorted(parts):
        raise CheckpointError(
            f"checkpoint {path} is sharded (torch.distributed.checkpoint shards in {folder}) and "
            "this run does not shard the model: resume it with the plugin that wrote it "
            "(algorithms.fsdp), or resume from a full checkpoint (the default, "
            "sharded_checkpoint: false)"
        )
    dcp.load(parts, checkpoint_id=str(folder))
    return {**template, **parts}


def load_checkpoint(path: str | Path, map_location: Any = "cpu", *, mmap: bool = False) -> dict[str, Any]:
    """Read a checkpoint written by Slipstream, or raise CheckpointError saying why not.
    ``mmap``: the tensors stay in the file, read when used (a reader of many
    checkpoints, or of their metadata only, holds none in memory)."""
    path = Path(path)
    if path.is_dir():
        run = RunDir(path)
        if not run.latest.is_file() and not (path / LATEST).is_file():
            raise CheckpointError(
                f"no checkpoint in {path}: looked for {run.latest} (a run directory) and {path / LATEST} "
                "(its checkpoints folder); give a checkpoint file, or a run that wrote one"
            )
        path = run.latest if run.latest.is_file() else path / LATEST
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as exc:
        from slipstream.run.corrupt_checkpoint import unreadable_reason

        raise CheckpointError(f"checkpoint {path} cannot be read: {unreadable_reason(path, exc)}") from None
    if not isinstance(payload, dict) or payload.get("format") not in _FORMAT_ALIASES:
        raise CheckpointError(f"{path} is not a Slipstream checkpoint (no '{FORMAT}' format tag)")
    if payload.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} was written by a newer Slipstream (format {payload['format_version']}); "
            f"this one reads format {FORMAT_VERSION}"
        )
    return payload


def checkpoint_payload(
    state: State, algorithms: Sequence[Mapping[str, Any]], hook: Any = None
) -> dict[str, Any]:
    """What a checkpoint of ``state`` holds. ``algorithms`` are the run's plugin
    records (name, version, distribution, config) in the order of
    ``state.algorithms`` then ``state.callbacks``; each plugin's ``state_dict()`` is
    stored beside its record. ``hook`` is the run's
    hook relay: its ``state_dicts`` step gives the model's and optimizer's state (a
    parallelism plugin's, or the plain ``state_dict()``s without one)."""
    plugins = {
        # A plugin that keeps model weights says which (see Plugin.weights), so that a
        # reader can select them without importing the plugin.
        record["name"]: {**record, "state": plugin.state_dict(), **_weights_tag(plugin)}
        for plugin, record in zip([*state.algorithms, *state.callbacks], algorithms, strict=True)
    }
    state_dicts = _state_dicts(state, hook)  # every rank: may gather shards
    return {
        "model": state_dicts["model"],
        "optimizer": state_dicts["optimizer"],
        "optimizer_class": type(state.optimizer).__name__,
        "schedulers": [s.state_dict() for s in state.schedulers],
        "plugins": plugins,
        "timestamp": state.timestamp.state_dict(),
        "rng": rng_state(),
        # The variant each measured-auto plugin ran in: a resumed run keeps it.
        "variants": {
            a.name: a.variant for a in state.algorithms if getattr(a, "variant", None) is not None
        },
        "config": state.config,
        # The names behind the model's output indices, where the data has them: what
        # `eval` checks other data against and `export` writes beside the weights.
        "classes": dataset_classes(state.train_loader),
        # One sample's shape as the model takes it (C, H, W): the example inputs an
        # export of a checkpoint of a Trainer built in Python is traced with.
        "input_shape": _input_shape(state.batch),
        "world_size": state.world_size,
        "versions": library_versions(),
    }


def _input_shape(batch: Any) -> list[int] | None:
    inputs = batch[0] if isinstance(batch, (tuple, list)) and batch else None
    return list(inputs.shape[1:]) if isinstance(inputs, torch.Tensor) and inputs.dim() > 1 else None


def dataset_classes(loader: Any) -> list[str] | None:
    """The class names of ``loader``'s dataset, index by index (``.classes``, as
    torchvision's datasets and the built-in ones have), looking through wrappers that
    keep theirs in ``.dataset``; None where the data names none (a stream of shards)."""
    data = getattr(loader, "dataset", loader)
    for _ in range(4):
        classes = getattr(data, "classes", None)
        if isinstance(classes, (list, tuple)) and classes and all(isinstance(c, str) for c in classes):
            return list(classes)
        data = getattr(data, "dataset", None)
        if data is None:
            break
    return None


def class_mismatch(trained: Sequence[str] | None, data: Sequence[str] | None, sides: tuple[str, str]) -> str | None:
    """How the class names ``data`` has differ from those the model was ``trained`` on
    (``sides``: how a message names the two), or None where they agree or either side
    names none (a checkpoint of an older version, a stream of shards). An ImageFolder
    numbers its folders in sorted order, so differing names score index i as another class."""
    if not trained or not data or list(trained) == list(data):
        return None
    if sorted(trained) == sorted(data):
        first = list(trained)[:8], list(data)[:8]
        return f"the same classes in another order: the {sides[1]}'s {first[0]}, the {sides[0]}'s {first[1]}"
    only_data, only_trained = sorted(set(data) - set(trained))[:8], sorted(set(trained) - set(data))[:8]
    return f"only in the {sides[0]} {only_data}, only in the {sides[1]} {only_trained} (at most 8 of each shown)"


def _weights_tag(plugin: Any) -> dict[str, str]:
    kind = getattr(plugin, "weights", None)
    return {"weights": kind} if isinstance(kind, str) and kind else {}


def weights_in(payload: Mapping[str, Any]) -> list[str]:
    """The model weights checkpoint ``payload`` holds: ``model``, then those its
    plugins keep (``ema``)."""
    kept = [p["weights"] for p in payload.get("plugins", {}).values() if p.get("weights")]
    return ["model", *kept]


def select_weights(payload: Mapping[str, Any], weights: str, path: str | Path) -> dict[str, Any]:
    """The state_dict of the model weights named ``weights`` (see :func:`weights_in`)
    in ``payload``, or a CheckpointError naming those it holds."""
    if payload.get("shards"):
        raise CheckpointError(
            f"checkpoint {path} is sharded (torch.distributed.checkpoint): loading its weights "
            "alone needs a full checkpoint (algorithms.fsdp.sharded_checkpoint=false)"
        )
    if weights == "model":
        return payload["model"]
    for record in payload.get("plugins", {}).values():
        if record.get("weights") == weights and (record.get("state") or {}).get("weights"):
            return record["state"]["weights"]
    raise CheckpointError(
        f"checkpoint {path} holds no {weights!r} weights; it holds: {', '.join(weights_in(payload))}"
    )


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _head_like(own: Mapping[str, Any]) -> str:
    """A glob of the last module's weights (most often the classifier), as an example."""
    last = next(reversed(list(own)), "fc.weight")
    return last.rsplit(".", 1)[0] + ".*" if "." in last else last


def _listed(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def weight_problems(
    saved: Mapping[str, Any], own: Mapping[str, Any], leave_out: Sequence[str] = ()
) -> list[str]:
    """What keeps the weights ``saved`` from fitting a model whose state dict is
    ``own``: the missing, the unexpected and the mis-shaped, each a short list."""
    missing = [k for k in own if k not in saved and k not in leave_out]
    unexpected = [k for k in saved if k not in own]
    shapes = [
        f"{k} {tuple(saved[k].shape)} vs {tuple(own[k].shape)}"
        for k in saved
        if k in own and isinstance(saved[k], torch.Tensor) and saved[k].shape != own[k].shape
    ]
    return [
        f"{label}: {_listed(names)}"
        for label, names in (
            ("missing from the checkpoint", missing),
            ("unexpected (not in this model)", unexpected),
            ("of another shape (checkpoint vs model)", shapes),
        )
        if names
    ]


def load_weights(
    model: torch.nn.Module,
    path: str | Path,
    *,
    ignore_keys: Sequence[str] = (),
    weights: str = "model",
    verbose: bool = False,
    payload: Mapping[str, Any] | None = None,
) -> list[str]:
    """Load the model weights of checkpoint ``path`` into ``model`` (fine-tuning:
    no optimizer, schedule or counters), leaving the parameters and buffers that
    match the glob patterns ``ignore_keys`` as they are (a new head). ``weights``
    selects the model's own weights or a plugin's (``ema``). Every other weight must
    fit: missing, unexpected and mis-shaped ones are one CheckpointError listing
    them. Returns the names of the weights left as they were."""
    device = next(iter(model.state_dict().values()), torch.empty(0)).device
    payload = payload if payload is not None else load_checkpoint(path, map_location=device)
    saved = select_weights(payload, weights, path)
    own = model.state_dict()
    kept = {k: v for k, v in saved.items() if not _matches(k, ignore_keys)}
    ignored = [k for k in own if _matches(k, ignore_keys)]
    unmatched = [p for p in ignore_keys if not any(fnmatch.fnmatchcase(k, p) for k in (*own, *saved))]
    if unmatched:  # a typo would load the weights it meant to leave out, without a word
        raise ConfigError(
            f"trainer.load_ignore_keys: {', '.join(map(repr, unmatched))} matches no weight of "
            f"{type(model).__name__} or of checkpoint {path}; its weights are named like "
            f"{_listed(list(own), 4)} (globs, e.g. ['{_head_like(own)}'])"
        )
    problems = weight_problems(kept, own, leave_out=ignored)
    if problems:
        raise CheckpointError(
            f"checkpoint {path}: its {weights} weights do not fit {type(model).__name__}; "
            + "; ".join(problems)
            + ". Leave such weights at their initialisation with trainer.load_ignore_keys "
            "(globs, e.g. ['head.*'] for a new classifier)"
        )
    with torch.no_grad():
        model.load_state_dict(kept, strict=False)
    if verbose:
        note = f"; left as initialised: {_listed(ignored)}" if ignored else ""
        print(
            f"slipstream: loaded {len(kept)} {weights} weights from {path} (weights only){note}",
            file=sys.stderr,
        )
    return ignored


# Settings that do not change what a run computes: a requeued run may change them
# (trainer.max_duration included: a run cut short by it continues to the new one).
RESUME_MAY_CHANGE = (
    "trainer.run_dir",
    "trainer.autoresume",
    "trainer.load_path",
    "trainer.load_weights_only",
    "trainer.load_ignore_keys",
    "trainer.load_weights",
    "trainer.overwrite",
    "trainer.max_duration",
    "trainer.progress_bar",
    "trainer.verbose",
    "trainer.log_interval",
    "trainer.checkpoint_interval",
    "trainer.checkpoint_keep",
    "trainer.keep_best",
    "trainer.eval_interval",
    "trainer.best_metric",
    "trainer.target_accuracy",
    "trainer.target_metric",
    "trainer.stop_at_target",
    "trainer.threads",
    "trainer.device",
    "trainer.peak_tflops",
    "trainer.on_nonfinite",
    "data.root",
    "data.download",
    "data.num_workers",
    "data.pin_memory",
    "data.persistent_workers",
    "data.eval_batch_size",
    "callbacks",
    "evaluation",
)


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if prefix in KEYWORD_MAPPINGS:  # compared whole: {} and {"drop_rate": 0.5} differ
        return {prefix: plain(value) if value is not None else {}}
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: list(value) if isinstance(value, tuple) else value}


def config_differences(saved: Mapping[str, Any] | None, current: Mapping[str, Any] | None) -> list[str]:
    """The keys whose values differ between a checkpoint's config and this run's, in
    a way that changes training (not :data:`RESUME_MAY_CHANGE`). A key only one side
    has counts where it enables a plugin (``algorithms.<name>``); other keys that one
    side lacks come from another version and are left out. The keyword mappings
    (``model.kwargs``, ...) are compared whole, ``{}`` against a keyword included.
    Where the data is (the dataset's ``locations``, e.g. ``data.urls``) may change."""
    old, new = _flat(dict(saved or {})), _flat(dict(current or {}))
    free = (*RESUME_MAY_CHANGE, *data_locations(current))

    def may_change(key: str) -> bool:
        return any(key == k or key.startswith(k + ".") for k in free)

    differ = {k for k in old.keys() & new.keys() if old[k] != new[k] and not may_change(k)}
    for key in old.keys() ^ new.keys():
        parts = key.split(".")
        if parts[0] != "algorithms" or len(parts) < 2:
            continue
        plugin = ".".join(parts[:2])
        if not (_enabled(old, plugin) and _enabled(new, plugin)):
            differ.add(plugin)  # enabled on one side only
        elif len(parts) > 2:
            differ.add(key)  # an option set on one side, its default on the other
    return sorted(differ)


def _enabled(flat: Mapping[str, Any], plugin: str) -> bool:
    """Whether the flattened config enables ``algorithms.<name>`` (``{}``: its defaults)."""
    return plugin in flat or any(k.startswith(plugin + ".") for k in flat)


def resumed_with_changes(
    path: Path, saved: Mapping[str, Any] | None, current: Mapping[str, Any], keys: Sequence[str]
) -> str:
    """The warning for a resume (``trainer.load_path``) whose config differs from the
    checkpoint's in ``keys`` (:func:`config_differences`). A resume may change them,
    unlike autoresume, but the optimizer's state comes from the checkpoint, so its
    ``optimizer.*`` values stay (:func:`keep_saved_optimizer_settings`)."""
    old, new = _flat(dict(saved or {})), _flat(dict(current))

    def value(flat: dict[str, Any], key: str) -> str:
        if key in flat:
            if flat[key] == {} and key.startswith("algorithms."):
                return "on"  # an enabled plugin with default options
            return repr(flat[key])
        if _enabled(flat, key):
            return "on"
        return "its default" if key.count(".") >= 2 else "off"  # an option of an enabled plugin, or none

    applied = [f"{k} {value(old, k)} -> {value(new, k)}" for k in keys if not k.startswith("optimizer.")]
    kept = _kept_optimizer_keys(old, keys)
    told = f"slipstream: resuming from {path} with settings that differ from the run that wrote it. "
    if applied:
        told += f"Taking effect from here on: {', '.join(applied)}. "
    if kept:
        stays = ", ".join(f"{k} stays {value(old, k)} ({value(new, k)} asked)" for k in kept)
        told += f"Not taking effect, as the optimizer's state comes from the checkpoint: {stays}; config.yaml says so. "
    return told + "To train these weights with this run's settings from step 0, set trainer.load_weights_only=true"


def keep_saved_optimizer_settings(
    current: dict[str, Any], saved: Mapping[str, Any] | None, keys: Sequence[str]
) -> None:
    """Set the ``optimizer.*`` values among ``keys`` in ``current`` (the run's config,
    what config.yaml and its checkpoints record) back to the checkpoint's: the restored
    optimizer state runs with those, whatever the config asked."""
    old = _flat(dict(saved or {}))
    for key in _kept_optimizer_keys(old, keys):
        *sections, leaf = key.split(".")
        section = current
        for name in sections:
            section = section.setdefault(name, {})
        section[leaf] = old[key]


def _kept_optimizer_keys(old: Mapping[str, Any], keys: Sequence[str]) -> list[str]:
    return [k for k in keys if k.startswith("optimizer.") and k in old]


def _state_dicts(state: State, hook: Any) -> dict[str, Any]:
    if hook is not None:
        return hook.state_dicts(state=state)
    return {"model": state.unwrapped_model.state_dict(), "optimizer": state.optimizer.state_dict()}


def restore_checkpoint(
    state: State,
    path: str | Path,
    *,
    verbose: bool = False,
    hook: Any = None,
    payload: Mapping[str, Any] | None = None,
) -> None:
    """Load the checkpoint at ``path`` into ``state``: model, optimizer, schedulers,
    the state of each plugin of this run, timestamp and random generators. Raises
    CheckpointError when the model or optimizer does not fit it. ``hook`` is the run's
    hook relay: its ``load_state_dicts`` step loads the model and optimizer (and a
    sharded checkpoint is read into the shapes its ``state_dicts`` step gives).
    ``payload``: the checkpoint already read by :func:`load_checkpoint` (not read again)."""
    path = Path(path)
    if payload is None:
        payload = load_checkpoint(path, map_location=state.device)
    refuse_averaged(payload, path)
    # torch loads another optimizer's state without a word and fails at the
    # first step, so the class is compared first (older checkpoints lack it).
    saved_class = payload.get("optimizer_class")
    try:
        if saved_class not in (None, type(state.optimizer).__name__):
            raise ValueError(f"it holds the state of {saved_class}")
        state_dicts = {"model": payload["model"], "optimizer": payload["optimizer"]}
        if payload.get("shards"):
            state_dicts = load_shards(_state_dicts(state, hook), path, payload)
        if hook is not None:
            hook.load_state_dicts(state=state, state_dicts=state_dicts)
        else:
            state.unwrapped_model.load_state_dict(state_dicts["model"])
            state.optimizer.load_state_dict(state_dicts["optimizer"])
    except RuntimeError as exc:
        problems = []
        if not payload.get("shards") and isinstance(payload.get("model"), Mapping):
            problems = weight_problems(payload["model"], state.unwrapped_model.state_dict())
        detail = "; ".join(problems) if problems else " ".join(str(exc).split())[:400]
        raise CheckpointError(
            f"checkpoint {path} does not fit this model ({type(state.unwrapped_model).__name__}): "
            f"{detail}. {written_by(payload, state)}"
        ) from None
    except (ValueError, KeyError) as exc:
        raise CheckpointError(
            f"checkpoint {path}: optimizer state does not fit {type(state.optimizer).__name__} "
            f"({exc}). {written_by(payload, state)}"
        ) from None
    for scheduler, saved in zip(state.schedulers, payload.get("schedulers", []), strict=False):
        scheduler.load_state_dict(saved)
    saved_plugins = payload.get("plugins", {})
    everyone = [*state.algorithms, *state.callbacks]
    for plugin in everyone:
        if plugin.name in saved_plugins:
            plugin.load_state_dict(saved_plugins[plugin.name]["state"])
    missing = sorted(set(saved_plugins) - {p.name for p in everyone})
    if missing and verbose:
        print(
            f"slipstream: checkpoint state of {', '.join(missing)} not used (not in this run)",
            file=sys.stderr,
        )
    state.timestamp.load_state_dict(payload["timestamp"])
    set_rng_state(payload["rng"])
    saved_world = payload.get("world_size")
    saved_data = (payload.get("config") or {}).get("data") or {}
    saved_batch = saved_data.get("batch_size")
    if isinstance(saved_world, int) and saved_world != state.world_size and state.rank == 0:
        warnings.warn(world_size_changed(path, saved_world, state, saved_batch), stacklevel=2)
    elif isinstance(saved_world, int) and state.rank == 0:
        moved = batch_size_changed(path, saved_world, saved_batch, state)
        if moved:
            warnings.warn(moved, stacklevel=2)
    saved_workers = saved_data.get("num_workers")
    workers = getattr(state.train_loader, "num_workers", None)
    if (
        getattr(state.train_loader, "order_depends_on_workers", False)
        and isinstance(saved_workers, int)
        and isinstance(workers, int)
        and saved_workers != workers
        and state.rank == 0
    ):
        ts = state.timestamp
        rest = (
            f"the rest of epoch {ts.epoch} is split among {max(1, workers)} worker(s), so some of its samples "
            "are seen twice and others not at all, and "
            if ts.batch_in_epoch
            else ""
        )
        warnings.warn(
            f"slipstream: {path} was written with data.num_workers={saved_workers} and this run has "
            f"{workers}: this data's order depends on its workers, so {rest}later epochs come in another "
            f"order than that run's; resume with data.num_workers={saved_workers} to continue it exactly",
            stacklevel=2,
        )
    if verbose:
        ts = state.timestamp
        print(
            f"slipstream: resumed from {path} at epoch {ts.epoch}, batch {ts.batch}",
            file=sys.stderr,
        )


@dataclass
class StartFrom:
    """What a run starts from, decided before anything is built or written: the
    checkpoint it continues (read once, here), the weights it fine-tunes from
    (``weights_only``), or nothing. ``clear``: autoresume found the leftovers of an
    attempt that saved no checkpoint, to be cleared."""

    path: Path | None = None
    weights_only: bool = False
    payload: dict[str, Any] | None = None
    clear: bool = False

    @property
    def continues(self) -> Path | None:
        """The checkpoint this run continues (its run directory's files are kept); None
        for a fresh run, a fine-tuning one included."""
        return None if self.weights_only else self.path


def find_start(options: Any, config: Mapping[str, Any], device: Any, verbose: bool = False) -> StartFrom:
    """Where the run of ``options`` (validated TrainerOptions) and ``config`` starts:
    ``load_path``, or with ``autoresume`` the run directory's ``latest.pt`` (refused when
    its config differs in what changes training). A checkpoint that is continued is
    read here, once, onto ``device``."""
    start = StartFrom(Path(options.load_path) if options.load_path else None, bool(options.load_weights_only))
    if options.autoresume:
        start = _autoresumed(Path(options.run_dir), config, start, device, verbose)
    if start.path is not None and not start.path.exists():
        raise CheckpointError(f"trainer.load_path: checkpoint {start.path} does not exist")
    if start.continues is not None and start.payload is None:
        start.payload = load_checkpoint(start.path, map_location=device)
    if start.payload is not None:
        refuse_averaged(start.payload, start.path)
    return start


def refuse_averaged(payload: Mapping[str, Any], path: Any) -> None:
    """A checkpoint of ``slipstream average`` holds averaged weights and no optimizer
    state, schedules or generators: nothing a run could continue exactly."""
    averaged = payload.get("averaged")
    if isinstance(averaged, Mapping):
        raise CheckpointError(
            f"checkpoint {path} is an average of {len(averaged.get('sources') or ())} checkpoints "
            "(slipstream average): it holds weights but no optimizer state to continue a run from; "
            "fine-tune from it with trainer.load_weights_only=true, or evaluate or export it"
        )


def _autoresumed(run_dir: Path, config: Mapping[str, Any], start: StartFrom, device: Any, verbose: bool) -> StartFrom:
    paths = RunDir(run_dir)
    if not paths.latest.is_file():
        ended = paths.ended_as()
        if ended:  # clearing it would lose its results for a run of the same steps again
            raise ConfigError(
                f"trainer.autoresume: the run in {run_dir} ended ({ended}) and kept no checkpoint "
                "to continue from; nothing is changed. Choose another trainer.run_dir"
            )
        if verbose:
            print(f"slipstream: autoresume: no checkpoint in {run_dir}, starting", file=sys.stderr)
        return StartFrom(start.path, start.weights_only, clear=bool(paths.holds_run()))
    payload = load_checkpoint(paths.latest, map_location=device)
    differ = config_differences(payload.get("config"), config)
    if differ:
        raise ConfigError(
            f"trainer.autoresume: the run in {run_dir} was started with another config; "
            f"these keys differ: {', '.join(differ)}. Restore them, or choose another trainer.run_dir"
        )
    return StartFrom(paths.latest, payload=payload)


def resume(
    state: State,
    start: StartFrom,
    *,
    options: Any,
    config: dict[str, Any],
    hook: Any = None,
    verbose: bool = False,
) -> bool:
    """Load what the run starts from into ``state`` (after the plugins' ``init``): the
    weights of a fine-tuning run, or everything of a continued one, whose changed
    settings are told (and kept in ``state.summary["resumed_with_changes"]``; the
    optimizer's come from the checkpoint). True when a checkpoint was continued."""
    if start.path is None:
        return False
    if start.weights_only:
        load_weights(
            state.unwrapped_model,
            start.path,
            ignore_keys=options.load_ignore_keys,
            weights=options.load_weights,
            verbose=verbose,
        )
        return False
    payload = start.payload if start.payload is not None else load_checkpoint(start.path, state.device)
    restore_checkpoint(state, start.path, verbose=verbose, hook=hook, payload=payload)
    # Changed settings are allowed here (autoresume refused them before the start), but
    # never silent; told once the checkpoint is known to fit.
    saved = payload.get("config")
    changed = config_differences(saved, config)
    if changed:
        state.summary["resumed_with_changes"] = changed
        if state.rank == 0:
            warnings.warn(resumed_with_changes(start.path, saved, config, changed), stacklevel=3)
        keep_saved_optimizer_settings(config, saved, changed)
    return True


def written_in(path: Path | None) -> RunDir | None:
    """The run directory of the checkpoint ``path``, when it lies in one."""
    if path is None or path.parent.name != "checkpoints":
        return None
    return RunDir(path.parent.parent)


def world_size_changed(path: Path, saved: int, state: State, saved_batch: Any = None) -> str:
    """What a resume on another number of processes changes: allowed (a preempted job
    may come back on other nodes), but not the run the checkpoint's would have been.
    ``saved_batch``: the per-process batch of the run that wrote it (its config's), when
    known; else it is taken to be this run's."""
    ts = state.timestamp
    now = state.world_size
    per_rank = state.global_batch_size // now if state.global_batch_size else None
    before = saved * (saved_batch if isinstance(saved_batch, int) and saved_batch > 0 else per_rank or 0)
    if per_rank and before == now * per_rank:
        batch = f"a step still averages {before} samples, now {per_rank} from each process"
    elif per_rank and before:
        batch = f"a step now averages {now * per_rank} samples instead of {before}"
    else:
        batch = f"a step now averages {now} processes' batches instead of {saved}"
    rest = (
        f", and the rest of epoch {ts.epoch} comes from another split of its samples, so some "
        "are seen twice in it and others not at all"
        if ts.batch_in_epoch
        else ""
    )
    return (
        f"slipstream: {path} was written by {_processes(saved)} and this run has {now}. "
        f"Training goes on, but not as that run would have: {batch}{rest}. Resume with "
        f"{_processes(saved)} to continue it exactly"
    )


def batch_size_changed(path: Path, saved_world: int, saved_batch: Any, state: State) -> str | None:
    """What a mid-epoch resume with another batch size does to the rest of the epoch:
    the data's order continues at the same batch index, which is now another sample."""
    ts = state.timestamp
    if not ts.batch_in_epoch or not isinstance(saved_batch, int) or not state.global_batch_size:
        return None
    before, now = saved_world * saved_batch, state.global_batch_size
    if before == now:
        return None
    stopped, starts = ts.batch_in_epoch * before, ts.batch_in_epoch * now
    what = "skipped" if starts > stopped else "seen twice"
    return (
        f"slipstream: {path} stopped after batch {ts.batch_in_epoch} of epoch {ts.epoch} at {before} samples "
        f"a step, and this run takes {now}: the rest of the epoch starts at sample {starts} of its order, "
        f"not at sample {stopped} where that run stopped, so {abs(starts - stopped)} samples are {what} in "
        "this epoch. To change the batch size exactly, resume from a checkpoint at an epoch's end"
    )


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def written_by(payload: Mapping[str, Any], state: State) -> str:
    """What wrote the checkpoint ``payload`` against what ``state`` runs, for an
    error about a checkpoint that does not fit."""
    saved = payload.get("config") or {}
    model = (saved.get("model") or {}).get("name", "unknown")
    optimizer = (saved.get("optimizer") or {}).get("name", "unknown")
    return (
        f"It was written by a run of model {model!r} with optimizer {optimizer!r}; "
        f"this run has {type(state.unwrapped_model).__name__} and "
        f"{type(state.optimizer).__name__}. Resume with the same model and optimizer, "
        "or start afresh without load_path"
    )
