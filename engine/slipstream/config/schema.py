"""Structured run configuration and its merge order:
defaults < recipe (with ``extends``) < ``--algorithms`` / ``--callbacks`` < dotted overrides."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
import types
import typing
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from slipstream.config.options import (
    INT64,
    KEYWORD_MAPPINGS,
    TrainerOptions,
    config_dataclass,
    plain,
)
from slipstream.config.recipes import find_recipe
from slipstream.data.sources import READ_BY_SOME, DataConfig, dataset_class, eval_set_configs, readers, reads
from slipstream.duration import Duration
from slipstream.errors import ConfigError, ConfigWarning, SlipstreamError, did_you_mean, omegaconf_problem


@dataclass
class ModelConfig:
    # timm or torchvision name (prefix "timm/" or "torchvision/" to choose), or an import
    # path "package.module:build_net" called with num_classes and kwargs
    name: str = "resnet18"
    num_classes: Optional[int] = None  # None: the dataset's
    cifar_stem: bool = False  # 3x3 stride-1 stem, no max-pool: ResNets at 32 px
    pretrained: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the model's constructor


@dataclass
class OptimizerConfig:
    name: str = "sgd"  # sgd | adamw | adafactor | lamb | sgdw | an import path "package.module:Optimizer"
    lr: float = 0.1
    weight_decay: float = 5e-4
    momentum: float = 0.9  # sgd
    nesterov: bool = False  # sgd
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw
    eps: Optional[float] = None  # None: the optimizer's default
    impl: str = "auto"  # auto | fused | foreach | for_loop
    kwargs: dict[str, Any] = field(default_factory=dict)  # more keywords for the optimizer
    # Fine-tuning, at most one: the backbone's LR is lr x backbone_lr_scale (the head,
    # `head` globs or the model's classifier, keeps lr), or layer-wise decay (timm's
    # --layer-decay: each layer's LR is lr x layer_decay ** its depth from the top).
    backbone_lr_scale: Optional[float] = None
    layer_decay: Optional[float] = None
    head: Optional[list[str]] = None  # globs of the head's parameter names; None: the classifier


@dataclass
class LossConfig:
    name: str = "cross_entropy"  # cross_entropy | an import path "package.module:loss"
    kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. label_smoothing: 0.1


@dataclass
class EvaluationConfig:
    # What each evaluation measures: installed metric names (`slipstream metrics`), import
    # paths "package.module:Class", or a one-key mapping of either to its keyword
    # arguments ({calibration_error: {n_bins: 10}}); null: loss, accuracy, accuracy_top5
    # (the last with 5 classes or more). docs/metrics.md
    metrics: Optional[list[Any]] = None


# The trainer section follows TrainerOptions, the one definition of trainer settings.
TrainerConfig = config_dataclass(TrainerOptions, "TrainerConfig")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    # name -> options; presence enables the algorithm.
    algorithms: dict[str, Any] = field(default_factory=dict)
    # name -> options; presence enables the callback (called in this order).
    callbacks: dict[str, Any] = field(default_factory=dict)


SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "optimizer": OptimizerConfig,
    "loss": LossConfig,
    "trainer": TrainerConfig,
    "evaluation": EvaluationConfig,
}
# Sections that map plugin names to their options, and each one's entry-point group.
PLUGIN_SECTIONS = {"algorithms": "slipstream.algorithms", "callbacks": "slipstream.callbacks"}


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader refusing a key given twice in one mapping, which PyYAML keeps
    the last of without a word (two evaluation sets of one name would be one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"found the key {key!r} twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_recipe_file(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe as a plain dict, with its ``extends`` chain merged underneath it."""
    path = path.resolve()
    if path in _seen:
        chain = " -> ".join(p.name for p in (*_seen, path))
        raise ConfigError(f"recipe {path} extends itself: {chain}")
    try:
        raw = yaml.load(path.read_text(), Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe {path} is not valid YAML: {_yaml_problem(exc)}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read recipe {path}: {exc.strerror}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"recipe {path} must be a mapping with model/data/optimizer/trainer/algorithms sections"
        )
    parent = raw.pop("extends", None)
    check_keys(raw, source=str(path))
    removed = _recipe_plugins(raw, source=str(path))
    if parent is None:
        for section, names in removed.items():
            for name in names or ():
                warnings.warn(
                    f"recipe {path}: {section}.{name}: false removes nothing: the recipe extends none",
                    ConfigWarning,
                    stacklevel=2,
                )
        return raw
    try:
        parent_path = find_recipe(str(parent), relative_to=path.parent)
    except ConfigError as exc:
        raise ConfigError(f"recipe {path} extends {parent!r}, which cannot be found: {exc}") from None
    base = load_recipe_file(parent_path, (*_seen, path))
    for section, names in removed.items():
        inherited = base.get(section) or {}
        if names is None:  # `algorithms: {}` or `algorithms: null`: none of the parent's
            base[section] = {}
            continue
        for name in names:
            if name not in inherited:
                warnings.warn(
                    f"recipe {path}: {section}.{name}: false removes nothing: {parent} does not enable "
                    f"{name!r} (it enables: {', '.join(inherited) or 'none'})",
                    ConfigWarning,
                    stacklevel=2,
                )
            inherited.pop(name, None)
    for section, key in _emptied(raw):  # an empty mapping given here replaces the parent's
        if isinstance(base.get(section), dict):
            base[section].pop(key, None)
    return OmegaConf.to_container(OmegaConf.merge(base, raw))  # type: ignore[return-value]


def _emptied(layer: dict[str, Any]) -> list[tuple[str, str]]:
    """(section, key) of each :data:`KEYWORD_MAPPINGS` mapping that ``layer`` gives as
    ``{}``: it replaces the one below it, where a merge would keep that one."""
    pairs = [tuple(key.split(".")) for key in KEYWORD_MAPPINGS]
    return [(section, key) for section, key in pairs if (layer.get(section) or {}).get(key) == {}]


def _recipe_plugins(raw: dict[str, Any], source: str) -> dict[str, list[str] | None]:
    """A recipe's plugin sections as mappings of options: ``NAME:``, ``NAME: null`` and
    ``NAME: true`` enable it with its defaults, ``NAME: false`` removes one it inherits
    (as ``algorithms.NAME=false`` on the command line). Returns what to take from the
    parent: per section, the names removed, or None for none of its plugins (the section
    given as ``{}`` or null)."""
    removed: dict[str, list[str] | None] = {}
    for section in PLUGIN_SECTIONS:
        if section not in raw:
            continue
        plugins = raw[section]
        if not plugins:
            removed[section] = None
            raw[section] = {}
            continue
        for name, options in list(plugins.items()):
            if options is False:
                removed.setdefault(section, []).append(name)
                del plugins[name]
            elif options is None or options is True:
                plugins[name] = {}
            elif not isinstance(options, dict):
                raise ConfigError(
                    f"{source}: {section}.{name} is {options!r}; give its options as a mapping, true or "
                    "nothing to enable it with its defaults, or false to remove one the recipe extends"
                )
    return removed


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error in one line: what is wrong and where (line and column from 1),
    without the source excerpt it prints under the position."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem is None:
        return " ".join(str(exc).split())
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(exc, "context", None)
    return f"{problem}{where}" + (f" ({context})" if context else "")


def known_keys(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` without the sections and keys this version's schema lacks (a config
    written by another version, or a Python API run's description)."""
    out: dict[str, Any] = {}
    for section, values in cfg.items():
        if section in PLUGIN_SECTIONS and isinstance(values, dict):
            out[section] = values
        elif section in SECTIONS and isinstance(values, dict):
            fields = {f.name for f in dataclasses.fields(SECTIONS[section])}
            if section == "data" and any(key not in fields for key in values):
                # A dataset plugin's own keys (webdataset's urls, huggingface's path):
                # without them its run could not be rebuilt for eval or export.
                fields |= set(dataset_plugin_keys())
            out[section] = {k: v for k, v in values.items() if k in fields}
    return out


def check_keys(cfg: dict[str, Any], source: str) -> None:
    """Reject unknown keys, naming the closest valid one."""
    allowed_top = (*SECTIONS, *PLUGIN_SECTIONS, "extends")
    for section, values in cfg.items():
        if section not in allowed_top:
            raise ConfigError(
                f"{source}: unknown section {section!r}{did_you_mean(section, allowed_top)}; "
                f"allowed: {', '.join(allowed_top)}"
            )
        if section in PLUGIN_SECTIONS:
            if values is not None and not isinstance(values, dict):
                raise ConfigError(
                    f"{source}: {section!r} must map {section[:-1]} names to their options"
                )
            continue
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section {section!r} must be a mapping, got {values!r}")
        fields = [f.name for f in dataclasses.fields(SECTIONS[section])]
        if section == "data" and any(key not in fields for key in values):
            fields = [*fields, *(k for k in dataset_plugin_keys() if k not in fields)]
        for key in values:
            if key not in fields:
                valid = [f"{section}.{f}" for f in fields]
                raise ConfigError(
                    f"{source}: unknown key '{section}.{key}'"
                    f"{did_you_mean(f'{section}.{key}', valid)}; allowed in {section}: {', '.join(fields)}"
                )


def dataset_plugin_keys() -> list[str]:
    """Every data.* key some installed dataset plugin declares (imports the plugins)."""
    from slipstream.data.sources import dataset_keys, discover_datasets

    keys: list[str] = []
    for info in discover_datasets(load=True).values():
        if info.cls is not None:
            keys.extend(k for k in dataset_keys(info.cls) if k not in keys)
    return keys


def check_data(cfg: DictConfig) -> None:
    """``data.name`` is an installed dataset plugin and the data keys it declares are
    valid; a key only another dataset reads is an error naming the chosen one."""
    from slipstream.data.geometry import geometries
    from slipstream.data.sources import build_dataset_plugin

    dataset = build_dataset_plugin(plain(cfg.data))
    geometries(cfg.data, type(dataset).photos)  # the crop and resize options, checked
    check_eval_sets(cfg.data)
    check_task(type(dataset), cfg.data.name, cfg.loss.name)
    if cfg.data.repeats > 1 and type(dataset).streams:
        raise ConfigError(
            f"data.repeats={cfg.data.repeats} needs a map-style dataset: data.name={cfg.data.name} "
            "streams its samples, each once per epoch; use data.repeats=1"
        )


def check_eval_sets(data: DictConfig) -> None:
    """Each of ``data.eval_sets`` is a dataset description that builds (its plugin's keys,
    its geometry): a bad one is named by its set."""
    from slipstream.data.geometry import geometries
    from slipstream.data.sources import build_dataset_plugin, eval_set_configs

    if data.get("eval_sets") is None:
        return
    for name, described in eval_set_configs(data).items():
        try:
            dataset = build_dataset_plugin(dict(described))
            geometries(described, type(dataset).photos)
        except ConfigError as exc:
            raise ConfigError(f"data.eval_sets.{name}: {exc}") from None


def check_task(dataset: Any, name: str, loss: str) -> None:
    """A dataset's declared targets (``DatasetPlugin.task``) are ones the engine knows, and
    multi-hot targets do not meet the softmax cross-entropy, which would take them for one
    class's probabilities and train without a word."""
    task = getattr(dataset, "task", "multiclass")
    if task not in ("multiclass", "multilabel"):
        raise ConfigError(f"data.name={name} declares task={task!r}; a dataset's task is multiclass or multilabel")
    if task == "multilabel" and loss == "cross_entropy":
        raise ConfigError(
            f"data.name={name} has multi-hot targets (several labels per image), which loss.name=cross_entropy "
            "(one class per image) does not take: use loss.name=bce (one sigmoid per class)"
        )


def parse_algorithm_list(text: str) -> tuple[list[str], list[str]]:
    """``"a,b,no:c"`` -> (["a", "b"], ["c"])."""
    add, remove = [], []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item.startswith("no:"):
            remove.append(item[3:].strip())
        else:
            add.append(item)
    return add, remove


def _check_section_override(item: str) -> None:
    """Refuse ``trainer=5``: a whole section set to a plain value would drop, without a
    word, the section's overrides before it (and those after it would make it a mapping
    again). ``algorithms=null`` (none of the recipe's) stays allowed."""
    key, _, text = item.partition("=")
    key = key.strip()
    if key not in SECTIONS and key not in PLUGIN_SECTIONS:
        return
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return  # the parse below says what is wrong with it
    if isinstance(value, dict) or (value is None and key in PLUGIN_SECTIONS):
        return
    raise ConfigError(
        f"override {item!r} sets the whole section {key!r} to {value!r}, but it must be a mapping; "
        f"set its keys instead, e.g. {key}.<key>=value"
    )


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Dotted ``key=value`` pairs as a nested dict (values parsed as YAML)."""
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(
                f"override {item!r} must look like key=value, e.g. trainer.max_duration=5ep"
            )
    merged = OmegaConf.create()
    for item in overrides:
        _check_section_override(item)
        # Parsed one at a time so that the error names the override at fault; values
        # are YAML, whose parser raises its own errors, not omegaconf's.
        try:
            merged.merge_with_dotlist([item])
        except (OmegaConfBaseException, yaml.YAMLError) as exc:
            reason = " ".join(str(exc).split())
            if "scanning an alias" in reason:  # YAML reads a leading * as an alias, not a glob
                raise ConfigError(
                    f"cannot parse override {item!r}: YAML reads a value starting with * as an alias. "
                    "Quote each glob pattern inside the value, and the whole override in the shell: "
                    """'optimizer.head=["*fc*"]' or 'trainer.load_ignore_keys=["*.weight"]'"""
                ) from None
            raise ConfigError(
                f"cannot parse override {item!r}: {reason}. Values are YAML: quote the whole "
                "override in the shell, e.g. 'optimizer.betas=[0.9, 0.99]'"
            ) from None
    return OmegaConf.to_container(merged)  # type: ignore[return-value]


@dataclass(frozen=True)
class RunSpec:
    """A run as its configuration says it: the resolved config (read-only) and its
    trainer settings, validated (once, in :func:`build_run`)."""

    config: DictConfig
    options: TrainerOptions


def build_config(
    recipe: str | Path | None = None,
    algorithms: str | None = None,
    overrides: list[str] | None = None,
    callbacks: str | None = None,
    base: dict[str, Any] | None = None,
) -> DictConfig:
    """Resolve a run's configuration in the documented merge order. ``base`` (a
    checkpoint's config, for eval and export) goes under the recipe; keys this
    version does not know are dropped from it."""
    cfg = build_run(recipe, algorithms, overrides, callbacks, base).config
    OmegaConf.set_readonly(cfg, False)  # the caller's own copy (eval and export adjust theirs)
    return cfg


@functools.lru_cache(maxsize=1)
def _defaults() -> DictConfig:
    """The structured defaults of a run's config, made once (a fifth of a command's
    config time): callers copy it before changing it."""
    return OmegaConf.structured(RunConfig)


def build_run(
    recipe: str | Path | None = None,
    algorithms: str | None = None,
    overrides: list[str] | None = None,
    callbacks: str | None = None,
    base: dict[str, Any] | None = None,
) -> RunSpec:
    """:func:`build_config`, with the trainer settings it validated."""
    merged = copy.deepcopy(_defaults())  # a copy: the data section is opened below
    # The chosen dataset plugin's own keys join the data section (checked in validate).
    OmegaConf.set_struct(merged.data, False)
    layers: list[tuple[str, dict[str, Any]]] = []
    over = parse_overrides(list(overrides or []))
    check_keys(over, source="command line")
    if recipe is not None:
        path = find_recipe(str(recipe))
        layers.append((f"recipe {path}", load_recipe_file(path)))
    if base:
        named = [(layer.get("data") or {}).get("name") for _, layer in (*layers, ("", over))]
        layers.insert(0, ("the checkpoint's config", _base_for(known_keys(base), next(filter(None, named), None))))
    for source, layer in layers:
        merged = _merge(merged, layer, source)

    chosen = {}
    for section, flag in (("algorithms", algorithms), ("callbacks", callbacks)):
        given = section in over
        dotted = over.pop(section, None)
        # `algorithms={}` or `algorithms=null` takes none, as `algorithms: {}` in a recipe.
        chosen[section] = {} if given and not dotted else _plugin_section(merged, section, flag, dotted)
    for section, key in _emptied(over):  # key={} empties the mapping (later wins)
        merged[section][key] = {}
    _command_line_data(merged, over)
    merged = _merge(merged, over, "command line")
    for section, plugins in chosen.items():
        merged[section] = plugins
    _resolve_interpolations(merged)
    options = validate(merged)
    warn_no_ops(merged)
    OmegaConf.set_readonly(merged, True)  # what was validated is what runs
    return RunSpec(merged, options)


def _command_line_data(merged: DictConfig, over: dict[str, Any]) -> None:
    """The command line's ``data`` keys over a recipe's: ``data.<key>=null`` unsets a
    dataset plugin's key, and a ``data.name`` changed there drops the recipe's keys that
    only the recipe's dataset reads (``data.urls`` when switching to ``huggingface``),
    with a warning, as the engine's own keys of another dataset are (``data.root``)."""
    data = over.get("data")
    if not isinstance(data, dict):
        return
    engine = {f.name for f in dataclasses.fields(DataConfig)}
    for key in [k for k, v in data.items() if v is None and k not in engine]:
        del data[key]
        merged.data.pop(key, None)
    name, before = data.get("name"), merged.data.get("name")
    if name is None or name == before:
        return
    from slipstream.data.sources import dataset_class, dataset_keys

    try:
        own = set(dataset_keys(dataset_class(str(name))))
    except ConfigError:
        return  # validate() names the dataset that is not installed
    dropped = [k for k in list(merged.data) if k not in engine and k not in own and k not in data]
    for key in dropped:
        del merged.data[key]
    if dropped:
        keys = ", ".join(f"data.{k}" for k in dropped)
        warnings.warn(
            f"{keys} dropped: only data.name={before} reads {'them' if len(dropped) > 1 else 'it'}, "
            f"and the command line sets data.name={name}",
            ConfigWarning,
            stacklevel=3,
        )


def _base_for(base: dict[str, Any], data_name: str | None) -> dict[str, Any]:
    """A checkpoint's config under a recipe or overrides that name other data (eval on a
    held-out set): the data keys only its own dataset read go, so they are neither
    applied to the new one nor warned about as if the user had set them."""
    data = base.get("data") or {}
    if data_name is None or data_name == data.get("name"):
        return base
    own = set(READ_BY_SOME)
    general = {f.name for f in dataclasses.fields(SECTIONS["data"])} - own
    return {**base, "data": {k: v for k, v in data.items() if k in general}}


def _plugin_section(
    merged: DictConfig, section: str, flag: str | None, dotted: dict[str, Any] | None
) -> dict[str, Any]:
    """The plugins of ``section`` (algorithms or callbacks) with their options: the
    recipe's, then ``--<section> a,no:b``, then dotted ``<section>.<name>.<key>=v``."""
    plugins = dict(OmegaConf.to_container(merged[section]) or {})
    if flag:
        add, remove = parse_algorithm_list(flag)
        for name in add:
            plugins.setdefault(name, {})
        for name in remove:
            _remove_plugin(plugins, name, f"--{section} no:{name}", section)
    for name, options in (dotted or {}).items():
        # A dotted option for a plugin enables it: the user asked for it by name.
        if options is False or options is None:
            _remove_plugin(plugins, name, f"{section}.{name}={str(options).lower()}", section)
            continue
        current = plugins.get(name) or {}
        if not isinstance(options, dict):
            raise ConfigError(f"{section}.{name} must be given as {section}.{name}.<key>=<value>")
        plugins[name] = _deep_merge(current, options)
    return {name: (opts or {}) for name, opts in plugins.items()}


def _deep_merge(base: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """``more`` over ``base``, mappings merged key by key as omegaconf merges the other
    sections: ``algorithms.gpu_augmentation.erasing.mode=const`` changes the recipe's
    erasing mode and keeps its probability."""
    merged = dict(base)
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _remove_plugin(plugins: dict[str, Any], name: str, source: str, section: str = "algorithms") -> None:
    """Remove ``name``; removing what is not there is refused (a name no plugin
    has) or warned about (installed but not enabled), never silent."""
    if name in plugins:
        del plugins[name]
        return
    from slipstream.plugins.discovery import discover

    installed = discover(load=False, group=PLUGIN_SECTIONS[section])
    if name not in installed:
        raise ConfigError(
            f"{source}: no {section[:-1]} {name!r} is installed{did_you_mean(name, installed)}; "
            f"installed {section}: {', '.join(sorted(installed)) or 'none'}"
        )
    enabled = ", ".join(plugins) or "none"
    warnings.warn(
        f"{source} removes nothing: {name!r} is not enabled (enabled: {enabled})",
        ConfigWarning,
        stacklevel=3,
    )


def _resolve_interpolations(cfg: DictConfig) -> None:
    """Resolve every ${...} now, so that one that cannot resolve is a config error
    naming the key, not a failure later in the run."""
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as exc:
        key, message = omegaconf_problem(exc)
        raise ConfigError(
            f"{key}: cannot resolve its interpolation ({message}); ${{a.b}} must name "
            "another key of the config, e.g. ${trainer.seed}, or ${oc.env:NAME} a set "
            "environment variable"
        ) from None


def _merge(base: DictConfig, layer: dict[str, Any], source: str) -> DictConfig:
    for section, schema in SECTIONS.items():
        if isinstance(layer.get(section), dict):
            _check_shapes(layer[section], schema, section, source)
    try:
        return OmegaConf.merge(base, layer)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        key, message = omegaconf_problem(exc)
        raise ConfigError(f"{source}: bad value for {key}: {message}") from None


def _check_shapes(values: dict[str, Any], schema: type, prefix: str, source: str) -> None:
    """Values of the shape each key takes, said in the user's words: a true/false setting
    takes true or false (omegaconf would read 2 as true and 0 as false, and the run would
    go on with a setting nobody wrote), a list a list, a mapping or a section a mapping
    (where omegaconf's own message names its node classes)."""
    hints = typing.get_type_hints(schema)
    for key, value in values.items():
        if key not in hints:
            if "." in prefix:  # a nested section's key (the sections' own are check_keys')
                valid = [f"{prefix}.{k}" for k in hints]
                raise ConfigError(
                    f"{source}: unknown key '{prefix}.{key}'{did_you_mean(f'{prefix}.{key}', valid)}; "
                    f"allowed in {prefix}: {', '.join(hints)}"
                )
            continue
        hint, optional = _unwrap_optional(hints[key])
        name = f"{prefix}.{key}"
        if value is None and optional:
            continue
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                some = dataclasses.fields(hint)[0].name
                raise ConfigError(f"{source}: {name} is a section of keys, not {value!r}; set one as {name}.{some}=...")
            _check_shapes(value, hint, name, source)
        elif hint is bool and not isinstance(value, bool):
            raise ConfigError(f"{source}: {name} is true or false, got {value!r}")
        elif _origin(hint) in (list, tuple, Sequence) and not isinstance(value, list):
            raise ConfigError(f"{source}: {name} is a list, got {value!r}; e.g. '{name}=[a, b]' (quoted in the shell)")
        elif _origin(hint) is dict and not isinstance(value, dict):
            raise ConfigError(f"{source}: {name} is a mapping of keywords, got {value!r}; set one as {name}.KEY=VALUE")


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else hint), True
    return hint, False


def _origin(hint: Any) -> Any:
    return typing.get_origin(hint) or hint


def validate(cfg: DictConfig) -> TrainerOptions:
    """Checks that the types alone do not express; returns the trainer settings,
    validated."""
    _check_numbers(cfg)
    options = TrainerOptions.from_config(cfg.trainer).validate(prefix="trainer.")
    if cfg.data.batch_size < 1:
        raise ConfigError(f"data.batch_size must be at least 1, got {cfg.data.batch_size}")
    if cfg.data.eval_batch_size is not None and cfg.data.eval_batch_size < 1:
        raise ConfigError(
            f"data.eval_batch_size must be at least 1 or null (2 x batch_size), "
            f"got {cfg.data.eval_batch_size}"
        )
    if cfg.data.repeats < 1:
        raise ConfigError(
            f"data.repeats is how many times each sample is seen per epoch, a whole number from 1 "
            f"(1: no repeats), got {cfg.data.repeats}"
        )
    if cfg.data.image_size < 8:
        raise ConfigError(f"data.image_size must be at least 8 pixels, got {cfg.data.image_size}")
    if not 0 <= cfg.data.num_workers <= MAX_WORKERS:
        raise ConfigError(
            f"data.num_workers is the number of loader processes: from 0 to {MAX_WORKERS} "
            f"on this machine, got {cfg.data.num_workers}"
        )
    if cfg.model.num_classes is not None and cfg.model.num_classes < 1:
        raise ConfigError(f"model.num_classes must be at least 1, got {cfg.model.num_classes}")
    if cfg.optimizer.lr <= 0:
        raise ConfigError(f"optimizer.lr must be positive, got {cfg.optimizer.lr}")
    if cfg.optimizer.weight_decay < 0:
        raise ConfigError(f"optimizer.weight_decay must be 0 or more, got {cfg.optimizer.weight_decay}")
    check_data(cfg)
    check_evaluation(cfg, options)
    return options


def check_evaluation(cfg: DictConfig, options: TrainerOptions) -> None:
    """``evaluation.metrics``: installed names or importable classes that apply to the
    run's targets and class count, and holding what ``best_metric`` and
    ``target_accuracy`` read (their values are checked again once built)."""
    from slipstream.plugins.metric import check_applies, check_monitored, parse_metrics, task_best_metric

    metrics = cfg.evaluation.metrics
    task = data_task(cfg)
    options.best_metric = task_best_metric(options.best_metric, task)
    specs = parse_metrics(OmegaConf.to_container(metrics) if metrics is not None else None, task)
    check_applies(specs, task, known_num_classes(cfg))
    if options.eval_interval is None:
        return
    sets = list(eval_set_configs(cfg.data))  # SET/METRIC names one of them
    check_monitored(options.best_metric, specs, sets=sets)
    for name, cls in _enabled_callbacks(cfg).items():
        option = cls.monitor_option
        if option is not None and option in (cfg.callbacks[name] or {}):
            monitored = task_best_metric(cfg.callbacks[name][option], task)
            check_monitored(monitored, specs, f"callbacks.{name}.{option}", sets)
    if options.target_accuracy is not None:
        target = task_best_metric(options.target_metric, task)
        check_monitored(target, specs, "trainer.target_metric", sets, "trainer.target_accuracy")


# More loader processes than this only thrash (and a typo of a few digits would
# start thousands of them).
MAX_WORKERS = max(32, 4 * (os.cpu_count() or 1))


def _check_numbers(cfg: DictConfig) -> None:
    """Every number in the engine's sections (model.kwargs included) is one torch
    can take: integers within 64 bits, floats finite."""
    for section in SECTIONS:
        for key, value in _leaves(OmegaConf.to_container(cfg[section]), section):
            if isinstance(value, bool):
                continue
            if isinstance(value, int) and not INT64[0] <= value <= INT64[1]:
                raise ConfigError(
                    f"{key}={value} is too large: whole numbers must fit in 64 bits "
                    f"(at most {INT64[1]})"
                )
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{key}={value}: must be a finite number")


def _leaves(value: Any, key: str) -> Any:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{key}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{key}[{i}]")
    else:
        yield key, value


# Keys that only some choices read: (key, who reads it, the choice's key). The data
# keys that only some dataset plugins read are the plugins' to say (_ignored_data_keys).
_READ_ONLY_BY = (
    ("optimizer.momentum", ("sgd", "sgdw"), "optimizer.name"),
    ("optimizer.nesterov", ("sgd", "sgdw"), "optimizer.name"),
    ("optimizer.betas", ("adamw", "lamb"), "optimizer.name"),
    ("optimizer.eps", ("adamw", "adafactor", "lamb"), "optimizer.name"),
)


def _only_at_the_end(interval: Any, max_duration: Any) -> bool:
    try:
        every, total = Duration.parse(interval), Duration.parse(max_duration)
    except (ValueError, TypeError):
        return False
    if every.unit == "dur":
        return every.value >= 1
    return every.unit == total.unit and every.value >= total.value


def warn_no_ops(cfg: DictConfig) -> None:
    """Warn about settings changed from their default that this run would ignore."""
    defaults = _defaults()

    def changed(key: str) -> bool:
        return OmegaConf.select(cfg, key) != OmegaConf.select(defaults, key)

    ignored = _ignored_data_keys(cfg, changed) + [
        f"{key} is ignored with {choice}={OmegaConf.select(cfg, choice)} "
        f"(only {' and '.join(readers)} read it)"
        for key, readers, choice in _READ_ONLY_BY
        if changed(key) and OmegaConf.select(cfg, choice) not in readers
    ]
    callbacks = _enabled_callbacks(cfg)
    evaluated = [name for name, cls in callbacks.items() if cls.needs_evaluation]
    t, d = cfg.trainer, cfg.data
    if t.checkpoint_interval is None and changed("trainer.checkpoint_keep"):
        ignored.append("trainer.checkpoint_keep is ignored: trainer.checkpoint_interval=null")
    if t.checkpoint_interval is None and changed("trainer.keep_best"):
        ignored.append("trainer.keep_best is ignored: trainer.checkpoint_interval=null")
    elif t.checkpoint_keep == -1 and changed("trainer.keep_best"):
        ignored.append("trainer.keep_best is ignored: trainer.checkpoint_keep=-1 keeps every checkpoint")
    elif t.eval_interval is None and changed("trainer.keep_best"):
        ignored.append("trainer.keep_best is ignored: trainer.eval_interval=null (no checkpoint has a metric)")
    if t.eval_interval is None and changed("data.eval_batch_size"):
        ignored.append("data.eval_batch_size is ignored: trainer.eval_interval=null")
    if cfg.optimizer.head is not None and cfg.optimizer.backbone_lr_scale is None:
        ignored.append("optimizer.head is ignored: only optimizer.backbone_lr_scale reads it")
    if d.persistent_workers and d.num_workers == 0:
        ignored.append("data.persistent_workers is ignored: data.num_workers=0 starts no workers")
    if t.eval_interval is None:
        if changed("trainer.best_metric") and t.best_metric is not None:
            ignored.append("trainer.best_metric is ignored: trainer.eval_interval=null (no best.pt)")
        if t.target_accuracy is not None:
            ignored.append("trainer.target_accuracy is never reached: trainer.eval_interval=null")
        ignored += [f"callbacks.{name} never stops the run: trainer.eval_interval=null" for name in evaluated]
    elif evaluated and _only_at_the_end(t.eval_interval, t.max_duration):
        ignored += [
            f"callbacks.{name} never stops the run: trainer.eval_interval={t.eval_interval} evaluates "
            f"only at its end (max_duration={t.max_duration}), and the final evaluation never stops a run"
            for name in evaluated
        ]
    classes = known_num_classes(cfg)
    if classes is not None and classes < 5:
        if t.best_metric == "accuracy_top5":
            ignored.append(f"trainer.best_metric=accuracy_top5 is ignored: the runs have {classes} classes (< 5)")
        for name, cls in callbacks.items():
            option = cls.monitor_option
            if option is not None and (cfg.callbacks[name] or {}).get(option) == "accuracy_top5":
                ignored.append(f"callbacks.{name}.{option}=accuracy_top5 never stops the run: {classes} classes (< 5)")
    for message in ignored:
        warnings.warn(message, ConfigWarning, stacklevel=3)


def data_task(cfg: DictConfig) -> str:
    """The targets the dataset of ``cfg`` declares (``DatasetPlugin.task``): class
    indices (``multiclass``) or multi-hot vectors (``multilabel``)."""
    try:
        return str(dataset_class(str(cfg.data.name)).task)
    except ConfigError:
        return "multiclass"  # not installed: validate() says so


def known_num_classes(cfg: DictConfig) -> int | None:
    """The classes a run of ``cfg`` has, where the config alone says (None: unknown
    before the data is read)."""
    if cfg.model.num_classes is not None:
        return int(cfg.model.num_classes)
    try:
        value = dataset_class(str(cfg.data.name)).known_num_classes(cfg.data)
    except ConfigError:
        return None  # not installed: validate() says so
    return int(value) if value is not None else None


def _ignored_data_keys(cfg: DictConfig, changed: Any) -> list[str]:
    """Each ``data.*`` key that only some dataset plugins read, changed from its default
    where the chosen plugin does not read it (``data.root`` for synthetic)."""
    keys = [key for key in READ_BY_SOME if changed(f"data.{key}")]
    if not keys:
        return []
    try:
        chosen = dataset_class(str(cfg.data.name))
    except ConfigError:
        return []
    messages = []
    for key in keys:
        if not reads(chosen, key):
            names = readers(key)
            who = f"only {' and '.join(names)} read it" if names else "no installed dataset reads it"
            messages.append(f"data.{key} is ignored with data.name={cfg.data.name} ({who})")
    return messages


def _enabled_callbacks(cfg: DictConfig) -> dict[str, Any]:
    """The classes of the callbacks ``cfg`` enables, by name (those that fail to load
    are left out: building the run names them)."""
    names = list(cfg.get("callbacks") or {})
    if not names:
        return {}
    from slipstream.plugins.discovery import CALLBACKS_GROUP, algorithm_class, discover

    installed = discover(load=False, group=CALLBACKS_GROUP)
    found = {}
    for name in names:
        try:
            found[name] = algorithm_class(name, installed, CALLBACKS_GROUP)
        except SlipstreamError:
            continue
    return found


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def to_dict(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
