"""Moving a batch to the device, and the one mapping of dict batches to ``(inputs, targets)``.

A batch enters the loop here, once: at training in the loop's mover, at evaluation in
:func:`to_device`. A dict batch (Hugging Face datasets, a collate_fn of one's own)
becomes the tuple every plugin indexes: its inputs are the first of
:data:`INPUT_KEYS` it holds, its targets the first of :data:`TARGET_KEYS`, and any other
keys ride along as a dict in third place (``(inputs, targets, {key: value})``), moved
to the device too. docs/plugins.md ("The batch") states the contract.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from slipstream.errors import ConfigError

# The keys a dict batch may name its inputs and its targets by, in the order looked for
# (torchvision's and timm's "image"/"label", Hugging Face's "pixel_values"/"labels").
INPUT_KEYS: tuple[str, ...] = ("image", "images", "pixel_values", "inputs", "input")
TARGET_KEYS: tuple[str, ...] = ("label", "labels", "targets", "target")


def as_pair(batch: Any) -> Any:
    """A dict batch as ``(inputs, targets)`` (plus a dict of its other keys, if any);
    any other batch, or a dict without an inputs key and a targets key, as it is
    (:func:`check_pair` then names its keys and the ones looked for)."""
    if not isinstance(batch, dict):
        return batch
    inputs = next((key for key in INPUT_KEYS if key in batch), None)
    targets = next((key for key in TARGET_KEYS if key in batch), None)
    if inputs is None or targets is None:
        return batch
    rest = {key: value for key, value in batch.items() if key not in (inputs, targets)}
    return (batch[inputs], batch[targets], rest) if rest else (batch[inputs], batch[targets])


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor on ``device``; lists and tuples become tuples, and a
    dict batch becomes ``(inputs, targets, ...)`` (:func:`as_pair`)."""
    return _move(as_pair(batch), device)


def _move(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        if batch.device == device:  # no `to`: its dispatch costs a step of a tiny model 1 %
            return batch
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, (list, tuple)):
        return tuple([_move(item, device) for item in batch])
    if isinstance(batch, dict):  # inside a batch: moved, kept a dict
        return {key: _move(value, device) for key, value in batch.items()}
    return batch


def batch_mover(device: torch.device) -> Callable[[Any], Any]:
    """:func:`to_device` for one ``device``, as the loop calls it every batch.

    On CPU, a list or tuple of plain CPU tensors (what a DataLoader yields) is
    recognised with one ``is_cpu`` per tensor and becomes a tuple as it is: between
    the steps of a small model each torch attribute read costs microseconds (reading
    ``tensor.device`` and ``device.type`` made the general path 5 us, 0.5 % of a
    1 ms step). Anything else takes the general path.
    """
    if device.type != "cpu":
        return lambda batch: to_device(batch, device)
    tensor = torch.Tensor

    def on_cpu(batch: Any) -> Any:
        if type(batch) is tuple or type(batch) is list:
            for item in batch:
                if type(item) is not tensor or not item.is_cpu:
                    break
            else:
                return tuple(batch)
        return to_device(batch, device)

    return on_cpu


def check_pair(batch: Any, kind: str) -> None:
    """Refuse a batch that is not ``(inputs, targets, ...)``: indexed as one, a lone
    tensor would give its first sample as the inputs, and a dict a KeyError."""
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return
    if isinstance(batch, dict):
        what = f"a dict with keys {sorted(map(str, batch))}"
    elif isinstance(batch, (tuple, list)):
        what = f"a {type(batch).__name__} of {len(batch)}"
    elif isinstance(batch, torch.Tensor):
        what = f"one tensor of shape {tuple(batch.shape)}"
    else:
        what = f"a {type(batch).__name__}"
    article = "an" if kind[0] in "aeiou" else "a"
    raise ConfigError(
        f"{article} {kind} batch must be a tuple or list (inputs, targets, ...), as a DataLoader of "
        f"(input, target) samples yields, or a dict with inputs under one of {'/'.join(INPUT_KEYS)} and "
        f"targets under one of {'/'.join(TARGET_KEYS)}; got {what}: have the dataset return (input, target), "
        "or give the DataLoader a collate_fn that makes the pair"
    )
