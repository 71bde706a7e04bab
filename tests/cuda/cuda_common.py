"""What the CUDA tests share (imported as `cuda_common`): the marker that skips them
without a GPU, and a run of a small model on the GPU through the Python API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from slipstream import Trainer
from slipstream.data import build_datasets, build_loader

HAS_CUDA = torch.cuda.is_available()
# Every module under tests/cuda sets `pytestmark = CUDA`.
CUDA = [
    pytest.mark.cuda,
    pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA: torch.cuda.is_available() is False on this machine"),
]
MIB = 2**20


def synthetic_loaders(
    *, n: int = 128, image_size: int = 32, batch_size: int = 32, pin_memory: bool = True, seed: int = 0
) -> tuple[DataLoader, DataLoader]:
    """The built-in shapes as the CLI loads them: uint8 batches, pinned on CUDA."""
    train, val, _ = build_datasets("synthetic", image_size=image_size, train_size=n, val_size=32, num_classes=4)
    return (
        build_loader(train, batch_size=batch_size, seed=seed, pin_memory=pin_memory),
        build_loader(val, batch_size=batch_size, shuffle=False, drop_last=False, pin_memory=pin_memory),
    )


def small_model(name: str = "test_resnet") -> torch.nn.Module:
    import timm

    torch.manual_seed(0)
    return timm.create_model(name, num_classes=4)


def fit_cuda(
    tmp_path: Path,
    algorithms: list[Any] = (),  # type: ignore[assignment]
    *,
    model: torch.nn.Module | None = None,
    loaders: tuple[DataLoader, DataLoader] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    max_duration: str = "4ba",
    **kwargs: Any,
) -> Trainer:
    """Fit on ``cuda`` and return the finished Trainer (quiet; no eval, no
    checkpoints unless asked for)."""
    model = model if model is not None else small_model()
    train, val = loaders or synthetic_loaders()
    kwargs.setdefault("eval_interval", None)
    kwargs.setdefault("checkpoint_interval", None)
    kwargs.setdefault("progress_bar", False)
    kwargs.setdefault("verbose", False)
    trainer = Trainer(
        model=model,
        optimizer=optimizer or torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        train_data=train,
        eval_data=val,
        max_duration=max_duration,
        algorithms=list(algorithms),
        run_dir=tmp_path / "run",
        device="cuda",
        **kwargs,
    )
    trainer.fit()
    return trainer
