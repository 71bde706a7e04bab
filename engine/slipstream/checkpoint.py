"""Checkpoint files: what they hold, written atomically, read with a clear error.

A checkpoint is a plain dict that ``torch.load(path, weights_only=True)`` reads:
the unwrapped model's ``state_dict``, the optimizer's, every scheduler's, every
plugin's state under its registered name (with version and config), the
timestamp, the random number generators and the resolved config. Together with
the seed-and-epoch data order, that is what a bit-exact resume needs.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError
from .rundir import LATEST, RunDir, atomic_write

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
