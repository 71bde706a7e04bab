"""Build a Trainer from a resolved config: what `slipstream train` runs."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from slipstream.config.options import TrainerOptions, apply_process_settings, seed_everything
from slipstream.config.schema import to_dict
from slipstream.data.datasets import DataError
from slipstream.data.sources import DataRequest, build_dataset_plugin
from slipstream.distributed import from_rank0, init_distributed, resolve_device
from slipstream.errors import ConfigError
from slipstream.models import build_loss, build_model
from slipstream.optim import build_optimizer
from slipstream.plugins.base import Plugin
from slipstream.plugins.discovery import PluginInfo, build_plugins, discover
from slipstream.run.directory import new_run_dir
from slipstream.trainer import Trainer


def default_run_dir(label: str) -> Path:
    return new_run_dir(label)


def build_trainer(
    cfg: DictConfig,
    *,
    label: str = "run",
    installed: dict[str, PluginInfo] | None = None,
    verbose: bool = True,
    plugins: tuple[list[Plugin], list[Plugin]] | None = None,
) -> Trainer:
    """Everything is validated (algorithms, callbacks, data, model, optimizer)
    before the run directory is touched, so a bad config costs nothing. ``plugins``:
    the algorithms and callbacks :func:`build_plugins` already built from ``cfg`` with
    ``installed`` (whose loaded entries name each plugin's distribution in the records)."""
    installed = discover(load=False) if installed is None else installed
    if plugins is None:
        plugins = build_plugins(dict(to_dict(cfg.algorithms)), dict(to_dict(cfg.callbacks)), installed)
    algorithms, callbacks = plugins
    t, d, m, o = cfg.trainer, cfg.data, cfg.model, cfg.optimizer
    dataset = build_dataset_plugin(dict(to_dict(d)))
    # The same options and validation as a Trainer built in Python; the process
    # settings come first so that data and model are built seeded.
    options = TrainerOptions.from_config(
        t,
        run_dir=t.run_dir or default_run_dir(label),
        normalize=dataset.stats if d.normalize else None,
        verbose=verbose,
    ).validate(prefix="trainer.")
    device = resolve_device(t.device)
    options.device = device
    apply_process_settings(options, device)
    seed_everything(options.seed)  # data and model are built seeded
    rank, world_size = init_distributed(device)
    # Named by each process's clock unless given: rank 0's name is the run's.
    options.run_dir = from_rank0(options.run_dir)

    request = DataRequest(
        image_size=d.image_size,
        batch_size=d.batch_size,
        eval_batch_size=d.eval_batch_size or 2 * d.batch_size,
        num_workers=d.num_workers,
        pin_memory=d.pin_memory and device.type == "cuda",
        persistent_workers=d.persistent_workers,
        drop_last=d.drop_last,
        seed=t.seed,
        rank=rank,
        world_size=world_size,
    )
    try:
        data = dataset.build(request)
    except DataError as exc:
        raise ConfigError(f"data: {exc}") from None
    except MemoryError:
        raise ConfigError(
            f"data: not enough memory to build {d.name!r} with data.train_size={d.train_size}, "
            f"data.val_size={d.val_size}, data.image_size={d.image_size}; make them smaller"
        ) from None
    train_loader, eval_loader, num_classes = data.train, data.eval, data.num_classes
    if data.stats is not None and d.normalize:
        options.normalize = data.stats
    if m.num_classes is not None and m.num_classes != num_classes:
        raise ConfigError(
            f"model.num_classes={m.num_classes} but the dataset {d.name!r} has {num_classes} classes"
        )
    model = build_model(
        m.name,
        num_classes,
        image_size=d.image_size,
        cifar_stem=m.cifar_stem,
        pretrained=m.pretrained,
        **dict(to_dict(m.kwargs)),
    )
    optimizer = build_optimizer(
        model,
        o.name,
        o.lr,
        weight_decay=o.weight_decay,
        momentum=o.momentum,
        nesterov=o.nesterov,
        betas=list(o.betas),
        eps=o.eps,
        impl=o.impl,
        device=device,
        kwargs=dict(to_dict(o.kwargs)),
        layer_decay=o.layer_decay,
        backbone_lr_scale=o.backbone_lr_scale,
        head=list(o.head) if o.head is not None else None,
    )
    loss_fn = build_loss(cfg.loss.name, **dict(to_dict(cfg.loss.kwargs)))
    resolved = to_dict(cfg)
    resolved["model"]["num_classes"] = num_classes
    return Trainer(
        model=model,
        optimizer=optimizer,
        loss_fn=loss_fn,
        train_data=train_loader,
        eval_data=eval_loader,
        algorithms=algorithms,
        callbacks=callbacks,
        config=resolved,
        installed=installed,
        options=options,
    )
