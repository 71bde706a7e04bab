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

import random
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError
from .rundir import LATEST, RunDir, atomic_write
from .state import State
from .versions import library_versions

FORMAT = "slipstream.checkpoint"
FORMAT_VERSION = 1


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _to_lists(random.getstate())}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_to_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
    own shards; a collective). An older folder of the same name is replaced."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state_dicts, checkpoint_id=str(folder))


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


def load_checkpoint(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """Read a checkpoint written by Slipstream, or raise CheckpointError saying why not."""
    path = Path(path)
    if path.is_dir():
        run = RunDir(path)
        path = run.latest if run.checkpoints.is_dir() else path / LATEST
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"checkpoint {path} is corrupt or not a PyTorch checkpoint ({reason[:200]})"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
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
        record["name"]: {**record, "state": plugin.state_dict()}
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
        "world_size": state.world_size,
        "versions": library_versions(),
    }


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
        detail = " ".join(str(exc).split())[:400]
        raise CheckpointError(
            f"checkpoint {path} does not fit this model: {detail}. {written_by(payload, state)}"
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
    if verbose:
        ts = state.timestamp
        print(
            f"slipstream: resumed from {path} at epoch {ts.epoch}, batch {ts.batch}",
            file=sys.stderr,
        )


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
