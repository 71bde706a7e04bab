"""What the compatibility tests share: the matrix's settings for short runs, the
per-plugin probes (the observable effects the single-algorithm tests check) and the
committed table. The three test files each run their part of the matrix once."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from slipstream.cli.compatibility import Observed, command_line, load_classes, load_file_plugin

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "compatibility.md"
FIVE = ("mixed_precision", "channels_last", "stepwise_lr", "image_size_curriculum", "gpu_augmentation")
# The example third-party plugin, not installed: the matrix loads it from its file.
ADD = ["examples/step_timer/slipstream_step_timer.py:StepTimer"]
SETTINGS = {
    "grad_accumulation": {"steps": 2},  # a group ends at the mid-run checkpoint (batch 5, the 2nd of epoch 1)
    "ghost_batchnorm": {"ghost_batch_size": 2},  # the matrix's batches of 4: 2 ghost batches (32 would be plain BN)
    "grad_clipping": {"max_norm": 0.5},  # it has no default
    # Grows within 4 batches; starts at 48 px on the CNN (see slipstream.cli.compatibility.CNN_IMAGE_SIZE).
    "image_size_curriculum": {"delay": 0.25, "finetune": 0.25, "initial_scale": 0.75},
    "mixed_precision": {"dtype": "bf16"},  # auto depends on the CPU; the effect shown is autocast's
    "torch_compile": {"backend": "aot_eager"},  # dynamo and AOT autograd without inductor's C++ builds
}
COMMAND = command_line(together=FIVE, settings=SETTINGS, add=ADD)


# Left out of the tests' runs (not of the table, which `slipstream compatibility` fills):
# dynamo traces a timm model for 15-30 s per run on this project's CPU, about the whole
# matrix's budget; tests/algorithms/test_torch_compile.py covers it alone.
SLOW = ("torch_compile",)


def classes(*, tested: bool = False) -> dict:
    """Every installed algorithm and the example; ``tested``: those the tests run."""
    extra = {}
    for spec in ADD:
        path, _, attr = spec.partition(":")
        cls = load_file_plugin(f"{ROOT / path}:{attr}")
        extra[cls.name] = cls
    found = load_classes(None, extra)
    return {k: v for k, v in found.items() if not (tested and k in SLOW)}


def _all(values, what: str) -> str | None:
    return None if values and all(values) else what


def _changed(seen: Observed) -> str | None:
    soft = any(t != r for t, r in zip(seen.target_shapes, seen.raw_target_shapes, strict=True))
    return None if soft or any(seen.inputs_changed) else "neither the inputs nor the targets changed"


def _grows(seen: Observed) -> str | None:
    sizes = [s[-1] for s in seen.input_shapes]
    full = seen.raw_shapes[0][-1]
    # It ends at the loader's size, or below it by a constant share where a plugin after
    # it drops rows and columns (colout).
    if not (sizes[0] < sizes[-1] <= full and sizes == sorted(sizes)):
        return f"input sizes {sizes}, loader's {full}"
    return None if {s[-1] for s in seen.eval_shapes} == {full} else f"eval sizes {seen.eval_shapes}"


def _reshaped(seen: Observed) -> bool:
    """A plugin changed the training images' size, so that values cannot be compared."""
    return any(s != r for s, r in zip(seen.input_shapes, seen.raw_shapes, strict=False))


def _dropped(seen: Observed) -> str | None:
    full = seen.raw_shapes[0]
    if not all(s[-1] < full[-1] and s[-2] < full[-2] for s in seen.input_shapes):
        return f"input sizes {seen.input_shapes}, loader's {full}"
    return None if {tuple(s[-2:]) for s in seen.eval_shapes} == {tuple(full[-2:])} else f"eval {seen.eval_shapes}"


def _smoothed(seen: Observed) -> str | None:
    pairs = [(a, b) for a, b in zip(seen.losses, seen.plain_losses, strict=True) if not math.isnan(b)]
    if not pairs:  # every batch mixed (soft targets): smoothing acts inside the mixed loss
        return None
    return None if any(abs(a - b) > 1e-3 for a, b in pairs) else "the loss is plain cross-entropy"


def _clipped(seen: Observed) -> str | None:
    limit = SETTINGS["grad_clipping"]["max_norm"]
    return None if seen.grad_norms and max(seen.grad_norms) <= limit * 1.001 else f"norms {seen.grad_norms}"


def _synced(seen: Observed) -> str | None:
    """sync_batchnorm: SyncBatchNorm layers under DDP; in one process none, and the summary says "not distributed"."""
    said = seen.summary.get("sync_batchnorm") or {}
    layers = sum(isinstance(m, torch.nn.SyncBatchNorm) for m in seen.model.modules()) if seen.model else 0
    if said.get("synchronised"):
        return None if layers == said.get("layers") > 0 else f"{layers} SyncBatchNorm layers, summary {said}"
    return None if not layers and str(said.get("reason")).startswith("not distributed") else f"summary {said}"


PROBES = {
    "activation_checkpointing": lambda s: None if s.summary.get("activation_checkpointing") else "nothing wrapped",
    "channels_last": lambda s: _all(s.inputs_channels_last, "inputs are not channels-last"),
    "cutmix": _changed,
    "ema": lambda s: None if s.summary.get("ema") else "no average kept",
    "blurpool": lambda s: None if (s.summary.get("blurpool") or {}).get("layers") else "nothing blurred",
    "colout": _dropped,
    "gpu_augmentation": lambda s: None if any(s.inputs_changed) or _reshaped(s) else "no batch changed",
    # Groups of 2 restart with each epoch of 3 batches: 2 steps an epoch.
    "grad_accumulation": lambda s: None if s.optimizer_steps * 3 == s.batches * 2 else f"{s.optimizer_steps} steps",
    "ghost_batchnorm": lambda s: None if s.summary.get("ghost_batchnorm", {}).get("chunks") == 2 else "not 2 chunks",
    "grad_clipping": _clipped,
    "image_size_curriculum": _grows,
    "label_smoothing": _smoothed,
    "layer_freezing": lambda s: None if s.summary.get("layer_freezing", {}).get("frozen_layers") else "no layer frozen",
    "locality_ffn": lambda s: None if len(s.final) > len(s.initial) else "no parameters added",
    "matmul_precision": lambda s: _all([p == "high" for p in s.matmul_precisions], "precision not 'high'"),
    "mixed_precision": lambda s: _all([d == torch.bfloat16 for d in s.output_dtypes], f"outputs {s.output_dtypes}"),
    "mixup": _changed,
    "sam": lambda s: None if s.summary.get("sam_steps") else "no SAM step",
    "selective_backprop": lambda s: None if s.summary.get("selective_backprop", {}).get("steps") else "no batch cut",
    "stochastic_depth": lambda s: None if s.summary.get("stochastic_depth", {}).get("blocks") else "no block dropped",
    "sync_batchnorm": _synced,
    "stepwise_lr": lambda s: None if len(set(s.lrs)) > 1 else f"LR constant {set(s.lrs)}",
    "swa": lambda s: None if s.summary.get("swa_models") else "no average taken",
    "torch_compile": lambda s: None if s.summary.get("compile_time_s") else "not compiled",
}
