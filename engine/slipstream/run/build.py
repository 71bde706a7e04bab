"""A Trainer built from a run's configuration: what `slipstream train`, a sweep's
trials, `eval` and `export` build, in the one order of construction (docs/architecture.md):
the validated specification, the plugins, the process set-up, then data, model,
optimizer and loss, then the Trainer's assembly."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from slipstream.config.options import check_output_dir
from slipstream.config.schema import RunSpec, to_dict
from slipstream.data.geometry import geometries
from slipstream.data.gpu_decode import choose_decode
from slipstream.data.sources import DATASETS_GROUP, DataRequest, build_dataset_plugin, eval_set_configs
from slipstream.distributed import from_rank0
from slipstream.errors import ConfigError, DataError
from slipstream.models import build_loss, build_model
from slipstream.optim import build_optimizer
from slipstream.plugins.base import Plugin
from slipstream.plugins.discovery import CALLBACKS_GROUP, PluginInfo
from slipstream.plugins.metric import record_key
from slipstream.plugins.registry import Registry
from slipstream.run.checkpoint import class_mismatch, dataset_classes
from slipstream.run.directory import new_run_dir
from slipstream.run.process import set_up_process
from slipstream.trainer import Trainer


def build_trainer(
    spec: RunSpec | DictConfig,
    *,
    label: str = "run",
    installed: dict[str, PluginInfo] | Registry | None = None,
    verbose: bool = True,
    plugins: tuple[list[Plugin], list[Plugin]] | None = None,
    eval_only: bool = False,
) -> Trainer:
    """Everything is validated (algorithms, callbacks, data, model, optimizer) before
    the run directory is touched, so a bad config costs nothing. ``spec``: what
    :func:`~slipstream.config.schema.build_run` returned (a bare config is validated
    here). ``plugins``: the algorithms and callbacks already built from it with
    ``installed``. ``eval_only`` (``slipstream eval`` and ``export``, which never train):
    the data's evaluation split alone where it has one (a folder of ``val/`` only, as
    ImageNet-V2 comes, evaluates; no training split is scanned), standing in for the
    training data too."""
    if not isinstance(spec, RunSpec):
        from slipstream.config.schema import validate

        spec = RunSpec(spec, validate(spec))
    cfg = spec.config
    registry = installed if isinstance(installed, Registry) else Registry(installed)
    if plugins is None:
        plugins = (registry.build(to_dict(cfg.algorithms)), registry.build(to_dict(cfg.callbacks), CALLBACKS_GROUP))
    d = cfg.data
    dataset = build_dataset_plugin(dict(to_dict(d)), registry.installed(DATASETS_GROUP))
    options = copy.copy(spec.options)  # validated by the config; what only this process knows goes on
    options.verbose = verbose
    options.normalize = dataset.stats if d.normalize else None
    if options.run_dir is None:
        options.run_dir = new_run_dir(label)
        check_output_dir(Path(options.run_dir), "trainer.run_dir")
    process = set_up_process(options)  # data and model are built seeded
    options.device = process.device
    # Named by each process's clock unless given: rank 0's name is the run's.
    options.run_dir = from_rank0(options.run_dir)
    # The images' geometry, the dataset's defaults filled in: what the loaders cut, and
    # what config.yaml (and a plugin reading state.config) records as having run.
    train_geometry, eval_geometry = geometries(cfg.data, type(dataset).photos, seed=cfg.trainer.seed)
    data = _build_data(dataset, cfg, process, train_geometry, eval_geometry, eval_only=eval_only)
    if eval_only and data.eval is None:  # nothing to evaluate: the training split gives export its inputs
        data = _build_data(dataset, cfg, process, train_geometry, eval_geometry)
    # data.decode=auto is measured on this data, outside the run's clock (docs/auto.md).
    decode = choose_decode(d.get("decode"), (data.train, data.eval), process.device, verbose=verbose)
    if data.stats is not None and d.normalize:
        options.normalize = data.stats
    model, optimizer, loss_fn = _build_model(cfg, data.num_classes, process.device)
    resolved = to_dict(cfg)
    resolved["model"]["num_classes"] = data.num_classes
    # As the eval records key it (val/accuracy of a first set val is accuracy): what average --best reads.
    resolved["trainer"]["best_metric"] = record_key(cfg.trainer.best_metric, list(eval_set_configs(cfg.data)))
    resolved["data"].update(
        train_crop=train_geometry.crop,
        hflip=train_geometry.hflip,
        eval_image_size=eval_geometry.size,
        crop_pct=eval_geometry.crop_pct,
    )
    algorithms, callbacks = plugins
    trainer = Trainer(
        model=model,
        optimizer=optimizer,
        loss_fn=loss_fn,
        train_data=data.train if data.train is not None else data.eval,  # eval_only: never trained on
        eval_data=_eval_sets(cfg, process, data, registry.installed(DATASETS_GROUP)),
        algorithms=algorithms,
        callbacks=callbacks,
        metrics=resolved["evaluation"]["metrics"],
        config=resolved,
        installed=registry,
        options=options,
        process=process,
    )
    if decode is not None:
        trainer.state.summary["decode"] = decode
    return trainer


def _eval_sets(cfg: DictConfig, process: Any, data: Any, installed: Any) -> Any:
    """The evaluation data: the dataset's own loader (one set, ``val``), or with
    ``data.eval_sets`` each set's loader by name, in the config's order; a set described
    as the ``data`` section evaluates that loader, another is built from its own
    description (its dataset, eval geometry)."""
    if cfg.data.get("eval_sets") is None:
        return data.eval
    base = {k: v for k, v in to_dict(cfg.data).items() if k != "eval_sets"}
    sets = {}
    for name, described in eval_set_configs(cfg.data).items():
        if described == base:
            sets[name] = data.eval
            continue
        dataset = build_dataset_plugin(dict(described), installed)
        train_geometry, eval_geometry = geometries(described, type(dataset).photos, seed=cfg.trainer.seed)
        own = SimpleNamespace(data=OmegaConf.create(described), trainer=cfg.trainer)
        try:  # its evaluation split alone: a set needs no training split (ImageNet-V2 has none)
            built = _build_data(dataset, own, process, train_geometry, eval_geometry, eval_only=True)  # type: ignore[arg-type]
        except ConfigError as exc:
            raise ConfigError(f"data.eval_sets.{name}: {exc}") from None
        if built.num_classes != data.num_classes:
            raise ConfigError(
                f"data.eval_sets.{name} has {built.num_classes} classes, the training data {data.num_classes}: "
                "an evaluation set is labelled as the model predicts"
            )
        _check_set_classes(name, dataset_classes(data.train) or dataset_classes(data.eval), dataset_classes(built.eval))
        sets[name] = built.eval
    return sets


def _check_set_classes(name: str, trained: list[str] | None, named: list[str] | None) -> None:
    """An evaluation set whose class folders are named otherwise than the training data's
    (ImageNet-V2's are 0..999, ImageNet's wnids) would score index i as another class."""
    detail = class_mismatch(trained, named, ("set", "training data"))
    if detail is not None:
        raise ConfigError(
            f"data.eval_sets.{name}: its classes are not the training data's ({detail}); "
            "each index would be scored as another class. Name its class folders as the training data's"
        )


def _build_data(
    dataset: Any, cfg: DictConfig, process: Any, train_geometry: Any, eval_geometry: Any, eval_only: bool = False
) -> Any:
    d = cfg.data
    request = DataRequest(
        image_size=d.image_size,
        batch_size=d.batch_size,
        eval_batch_size=d.eval_batch_size or 2 * d.batch_size,
        num_workers=d.num_workers,
        pin_memory=d.pin_memory and process.device.type == "cuda",
        persistent_workers=d.persistent_workers,
        drop_last=d.drop_last,
        repeats=d.repeats,
        seed=cfg.trainer.seed,
        rank=process.rank,
        world_size=process.world_size,
        train_geometry=train_geometry,
        eval_geometry=eval_geometry,
        eval_only=eval_only,
    )
    try:
        built = dataset.build(request)
    except DataError as exc:
        raise ConfigError(f"data: {exc}") from None
    except MemoryError:
        raise ConfigError(
            f"data: not enough memory to build {d.name!r} with data.train_size={d.train_size}, "
            f"data.val_size={d.val_size}, data.image_size={d.image_size}; make them smaller"
        ) from None
    if not eval_only and d.repeats > 1 and getattr(getattr(built.train, "sampler", None), "repeats", 1) != d.repeats:
        # A plugin that builds its own loaders and does not say it repeats (its sampler's
        # `repeats`) would train without repeats while the config says otherwise.
        raise ConfigError(
            f"data.repeats={d.repeats}: data.name={d.name} builds its own training loader, whose "
            "sampler does not repeat samples (no `repeats` attribute); use data.repeats=1"
        )
    return built


def _build_model(cfg: DictConfig, num_classes: int, device: Any) -> tuple[Any, Any, Any]:
    m, o = cfg.model, cfg.optimizer
    if m.num_classes is not None and m.num_classes != num_classes:
        raise ConfigError(
            f"model.num_classes={m.num_classes} but the dataset {cfg.data.name!r} has {num_classes} classes"
        )
    model = build_model(
        m.name,
        num_classes,
        image_size=cfg.data.image_size,
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
    if hasattr(loss_fn, "check_num_classes"):  # bce's per-class weights, checked before the run
        loss_fn.check_num_classes(num_classes)
    return model, optimizer, loss_fn
