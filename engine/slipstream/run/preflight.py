"""What a Trainer checks of what it is given before it builds anything: the objects
are what it takes, the data can give the epochs asked for, and the settings do
something with this data. Each problem is one line naming what was given and what
is allowed; what only wastes the run is a warning."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from slipstream.config.options import TrainerOptions
from slipstream.duration import Duration
from slipstream.errors import ConfigError, ConfigWarning
from slipstream.optim import check_optimizer_holds
from slipstream.services.evaluation import EVALUATION_OFF

# A plain DataLoader's samplers: every process that uses one reads all of the dataset.
WHOLE_DATASET_SAMPLERS = (torch.utils.data.RandomSampler, torch.utils.data.SequentialSampler)


def check_run(
    options: TrainerOptions,
    train_data: Any,
    eval_data: Any,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    max_duration: Duration,
    callbacks: list[Any],
    from_config: bool,
    world_size: int,
    warn: bool,
) -> None:
    """The checks of a run's data and settings together; ``warn``: this process tells
    the warnings (rank 0). ``from_config``: the CLI's config, which said its own."""
    o = options
    if (eval_data is None or (o.eval_interval is None and not from_config)) and warn:
        why = "no eval_data" if eval_data is None else "eval_interval=None"
        evaluated = [f"target_accuracy={o.target_accuracy} is never reached"] if o.target_accuracy else []
        evaluated += [f"the {c.name} callback never stops the run" for c in callbacks if c.needs_evaluation]
        for what in evaluated:
            warnings.warn(f"slipstream: {what}: {why}, so no evaluation", ConfigWarning, stacklevel=3)
    unoptimized = check_optimizer_holds(model, optimizer)
    if unoptimized and warn:
        warnings.warn(unoptimized, stacklevel=3)
    if isinstance(train_data, Iterator) and max_duration.unit == "ep" and max_duration.value > 1:
        raise ConfigError(
            f"train_data is a one-pass iterator ({type(train_data).__name__}): it has no second "
            f"epoch, and max_duration={max_duration} needs {max_duration.value:g}; pass a "
            "DataLoader (or anything iter() can start again), or give max_duration in batches"
        )
    if world_size > 1 and warn and isinstance(getattr(train_data, "sampler", None), WHOLE_DATASET_SAMPLERS):
        warnings.warn(
            f"slipstream: train_data's sampler is a {type(train_data.sampler).__name__}, so each of "
            f"the {world_size} processes trains on the whole dataset every epoch (the same samples "
            f"{world_size} times over); give it torch's DistributedSampler or "
            "slipstream.data.EpochSampler(rank=, world_size=), or build it with slipstream.data.build_loader",
            stacklevel=3,
        )
    if eval_data is not None and o.eval_interval is not None and batches_per_epoch(eval_data) == 0:
        raise ConfigError(f"the evaluation data is empty (no batches); give it samples, or {EVALUATION_OFF}")
    single = single_sample_last_batch(train_data)
    if single and warn:
        warnings.warn(
            f"slipstream: the training data's last batch of each epoch holds 1 sample ({single}); "
            "a model with batch norm cannot train on it: drop it (data.drop_last=true, or "
            "drop_last=True in the DataLoader) or choose another batch size",
            ConfigWarning,
            stacklevel=3,
        )
    if batches_per_epoch(train_data) is None:
        check_unknown_epoch_length(max_duration, o, warn=warn)


def check_arguments(model: Any, optimizer: Any, train_data: Any, eval_data: Any, loss_fn: Any) -> None:
    """The Trainer's objects are what it takes, or one line says what was given: each
    would otherwise fail later, deep in torch, with a message about something else."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"Trainer: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(optimizer, type):
        raise ConfigError(
            f"Trainer: optimizer must be an optimizer instance, got the class {optimizer.__name__}; "
            f"build it on the model's parameters, e.g. {optimizer.__name__}(model.parameters(), lr=0.1)"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"Trainer: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError(
            f"Trainer: loss_fn must be callable as loss_fn(outputs, targets), got {type(loss_fn).__name__} "
            f"{loss_fn!r}; e.g. torch.nn.CrossEntropyLoss(label_smoothing=0.1), or leave it out for cross-entropy"
        )
    for name, data in (("train_data", train_data), ("eval_data", eval_data)):
        if data is None and name == "eval_data":
            continue
        if isinstance(data, Dataset) and not isinstance(data, IterableDataset):
            raise ConfigError(
                f"Trainer: {name} is a {type(data).__name__}, a dataset of single samples; give batches: "
                "torch.utils.data.DataLoader(dataset, batch_size=...) or slipstream.data.build_loader(...)"
            )
        if not isinstance(data, Iterable):
            raise ConfigError(
                f"Trainer: {name} must be an iterable of (inputs, targets) batches, such as a "
                f"DataLoader; got {type(data).__name__}"
            )


def check_unknown_epoch_length(max_duration: Duration, options: TrainerOptions, warn: bool) -> None:
    """Without the number of batches in an epoch (train_data has no len()), a time inside
    an epoch cannot be placed: the run's time in epochs moves only at epoch ends."""
    if max_duration.unit == "ep" and not float(max_duration.value).is_integer():
        raise ConfigError(
            f"max_duration={max_duration}: train_data has no len(), so the run cannot tell where "
            f"{max_duration.value:g} epochs end and would train on to the next whole epoch; give "
            "max_duration in whole epochs or in batches (e.g. 500ba)"
        )
    for key in ("eval_interval", "checkpoint_interval"):
        value = getattr(options, key)
        try:
            every = Duration.parse(value) if value is not None else None
        except (ValueError, TypeError):
            continue
        if every is None:
            continue
        epochs = every.value if every.unit == "ep" else None
        if every.unit == "dur" and max_duration.unit == "ep":
            epochs = every.value * max_duration.value
        if epochs is not None and not float(epochs).is_integer() and warn:
            warnings.warn(
                f"slipstream: {key}={value} falls inside an epoch, and train_data has no len(), so the "
                "run cannot tell where: it acts at the first batch_end or epoch_end past the mark instead; "
                "give it in batches (e.g. 100ba) or in whole epochs",
                ConfigWarning,
                stacklevel=3,
            )


def checked_schedulers(schedulers: Any, optimizer: torch.optim.Optimizer) -> list[Any]:
    """The LR schedulers as a list (one scheduler alone is taken as it is), each on the
    Trainer's optimizer: a scheduler of another optimizer would move nothing the run
    trains with, and the run would end "completed" at its first LR."""
    if schedulers is None:
        return []
    if isinstance(schedulers, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        schedulers = [schedulers]
    if not isinstance(schedulers, Iterable) or isinstance(schedulers, (str, bytes)):
        raise ConfigError(
            f"Trainer: schedulers must be a list of torch LR schedulers, got {type(schedulers).__name__}"
        )
    schedulers = list(schedulers)
    for scheduler in schedulers:
        kind = type(scheduler).__name__
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ConfigError(
                "Trainer: ReduceLROnPlateau steps on a metric, and the loop steps schedulers without one; "
                "use a schedule of time (StepLR, CosineAnnealingLR, OneCycleLR, ...), or step it in your own "
                "algorithm's eval_end hook with state.eval_metrics['loss'] (docs/plugins.md)"
            )
        if not callable(getattr(scheduler, "step", None)):
            raise ConfigError(f"Trainer: schedulers holds a {kind}, which is no LR scheduler (it has no step())")
        if getattr(scheduler, "optimizer", optimizer) is not optimizer:
            raise ConfigError(
                f"Trainer: the {kind} in schedulers was built on another optimizer than the Trainer's, so it "
                "would change nothing the run trains with; build it on the optimizer you pass as optimizer="
            )
    return schedulers


def single_sample_last_batch(loader: Any) -> str | None:
    """What makes ``loader``'s last batch a single sample, when it keeps it (None else)."""
    batch_size = getattr(loader, "batch_size", None)
    if getattr(loader, "drop_last", True) or not isinstance(batch_size, int) or batch_size < 2:
        return None
    try:
        samples = getattr(loader, "num_samples", None) or len(loader.dataset)
    except (TypeError, AttributeError):
        return None
    if isinstance(samples, int) and samples % batch_size == 1:
        return f"{samples} samples in batches of {batch_size}"
    return None


def why_no_batches(loader: Any) -> str:
    """What made an epoch of ``loader`` empty, as far as its dataset, batch size and
    sampler tell, and what to change."""
    try:
        samples = len(loader.dataset)
    except (AttributeError, TypeError):  # an iterable without a length
        return "check the dataset and batch size"
    if samples == 0:
        return "its dataset is empty"
    sampler = getattr(loader, "sampler", None)
    batch_size = getattr(loader, "batch_size", None) or getattr(sampler, "batch_size", None)
    world = getattr(sampler, "world_size", 1)
    drops = getattr(sampler, "drop_last", False) or getattr(loader, "drop_last", False)
    if batch_size and drops and samples < batch_size * world:
        per = f"{batch_size} x {world} processes" if world > 1 else str(batch_size)
        return (
            f"its {samples} samples are fewer than one batch of {per}, and drop_last drops that "
            f"partial batch; use a batch size of at most {samples // world or 1}, more samples, or "
            "drop_last=False (data.batch_size, data.train_size, data.drop_last in a config)"
        )
    return f"{samples} samples, batch size {batch_size}; check the dataset's sampler"


def batches_per_epoch(loader: Any) -> int | None:
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "batches_per_epoch"):
        return int(sampler.batches_per_epoch)
    try:
        return len(loader)
    except TypeError:
        return None
