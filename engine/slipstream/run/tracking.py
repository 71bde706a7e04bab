"""Nested config and summary dicts as flat ``a.b.c`` keys, for experiment trackers
whose parameters and metrics are flat (TensorBoard hparams, MLflow params)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def flatten(value: Mapping[str, Any], sep: str = ".", prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level of ``sep``-joined keys; lists stay values.

    >>> flatten({"trainer": {"seed": 0, "max_duration": "2ep"}, "algorithms": {"ema": {}}})
    {'trainer.seed': 0, 'trainer.max_duration': '2ep', 'algorithms.ema': {}}
    """
    out: dict[str, Any] = {}
    for key, item in value.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(item, Mapping) and item:
            out.update(flatten(item, sep, name))
        else:
            out[name] = item
    return out


def numbers(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite-or-not numeric fields of a record (bools and None left out), with
    a list of numbers (``image_size``) as one field per item: ``image_size.0``.

    >>> numbers({"kind": "train", "loss": 0.5, "ok": True, "mfu": None, "image_size": [32, 32]})
    {'loss': 0.5, 'image_size.0': 32.0, 'image_size.1': 32.0}
    """
    out: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, (list, tuple)):
            out.update(numbers({f"{key}.{i}": item for i, item in enumerate(value)}))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    return out
