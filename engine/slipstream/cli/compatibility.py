"""The compatibility matrix: every installed algorithm alone, with every other one,
the design card's five together, with each optimizer, and under the parallel wraps,
each trained for a few batches on a tiny model. ``slipstream compatibility`` runs it
and writes docs/compatibility.md; the tests run it once and check every cell.

A combination *works* when it trains with finite losses, each plugin's probe (if one
is given: what the single-algorithm tests check, e.g. the autocast dtype) sees its
effect, and a checkpoint taken mid-run resumes to the same weights bit for bit. It is
*refused* when set-up raises a :class:`~slipstream.SlipstreamError` (one line, the
plugin's declaration) before the run directory exists. A pair *does not apply* when no
tiny model suits both plugins (each single is tried on a CNN and a ViT: refused on one
means it does not apply to it). Anything else is a *failure*, which the tests reject.

The engine names no plugin here either: everything comes from discovery, the plugins'
declarations and what a run observes. Options for a short run (``--set
algorithms.NAME.KEY=VALUE``) are given by whoever runs the matrix, and written into
the table's header.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import itertools
import json
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slipstream.errors import ConfigError, SlipstreamError, first_line
from slipstream.hookspecs import hookimpl
from slipstream.plugins.algorithm import Algorithm
from slipstream.plugins.discovery import discover, plugin_config
from slipstream.plugins.dispatch import raised_in
from slipstream.state import State

OPTIMIZERS = ("sgd", "adamw", "adafactor")
MODELS = ("cnn", "vit")
IMAGE_SIZE = 32  # the ViT's (8 px patches: at 0.75 of it a curriculum has 3x3 patches, not 2x2 rounded up)
# The CNN's: below 48 px the ImageNet stem leaves layer4 1x1 maps, where a bf16 autocast,
# channels-last stride-2 convolution returns non-finite gradients now and then (oneDNN;
# issue 23: on AMX, and seen here on AVX-512 BF16, about one run of two of the five
# together at 32 px), and the table would change from one run to the next. At 64 px,
# and 48 px at the start of a curriculum at initial_scale 0.75, layer4 sees 2x2 maps.
CNN_IMAGE_SIZE = 64
BATCH = 4
# Two epochs of 3 batches (per process), and the checkpoint the resume check starts from
# is taken after batch 5, the second of epoch 1: a plugin that keeps state across an
# epoch boundary in memory only (not in its state_dict) resumes to other weights. It ends
# a group of gradient accumulation (2 batches, groups restart with each epoch).
EPOCH_BATCHES = 3
BATCHES = 2 * EPOCH_BATCHES
RESUME_AT = EPOCH_BATCHES + 2
NUM_CLASSES = 4
# A parallel wrap is itself an algorithm when it is not DDP (the engine's default).
WRAP_PLUGIN = "fsdp"

WORKS = "works"
NOT_APPLICABLE = "does not apply"


# -- what a run shows --------------------------------------------------------------------------


@dataclass
class Observed:
    """What one run showed, for the probes: per training batch, the batch as it came
    from the loader (``raw``, normalised like the rest) and as the model got it, the
    output dtype, the loss, the LR after the step; the model at the end."""

    raw_shapes: list[tuple[int, ...]] = field(default_factory=list)
    input_shapes: list[tuple[int, ...]] = field(default_factory=list)
    inputs_channels_last: list[bool] = field(default_factory=list)
    inputs_changed: list[bool] = field(default_factory=list)  # same shape, other values
    target_shapes: list[tuple[int, ...]] = field(default_factory=list)
    raw_target_shapes: list[tuple[int, ...]] = field(default_factory=list)
    output_dtypes: list[torch.dtype] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    plain_losses: list[float] = field(default_factory=list)  # cross-entropy of the same outputs (nan: soft targets)
    grad_norms: list[float] = field(default_factory=list)  # total norm as the optimizer steps it
    matmul_precisions: list[str] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    optimizer_steps: int = 0
    batches: int = 0
    eval_shapes: list[tuple[int, ...]] = field(default_factory=list)
    model: nn.Module | None = None  # the unwrapped model at the end
    wrapped: nn.Module | None = None  # the model the loop called
    initial: dict[str, torch.Tensor] = field(default_factory=dict)  # weights before training
    final: dict[str, torch.Tensor] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    plugins: list[Algorithm] = field(default_factory=list)


class _Recorder(Algorithm):
    """Records an :class:`Observed`. Registered last, so its ``batch_start`` runs
    before every plugin's (it sees the loader's batch) and its ``before_forward``
    after them."""

    name = "compat_recorder"

    def __init__(self, observed: Observed, normalize: Callable[[Any], Any]) -> None:
        super().__init__()
        self.seen = observed
        self.normalize = normalize
        self._raw: torch.Tensor | None = None

    @hookimpl
    def batch_start(self, state: State) -> None:
        inputs, targets = state.batch[0], state.batch[1]
        self._raw = self.normalize((inputs.detach().clone(), None))[0]
        self.seen.raw_shapes.append(tuple(inputs.shape))
        self.seen.raw_target_shapes.append(tuple(targets.shape))

    @hookimpl
    def before_forward(self, state: State) -> None:
        inputs, targets = state.batch[0], state.batch[1]
        s = self.seen
        s.input_shapes.append(tuple(inputs.shape))
        s.target_shapes.append(tuple(targets.shape))
        s.inputs_channels_last.append(
            inputs.ndim == 4 and inputs.is_contiguous(memory_format=torch.channels_last)
        )
        raw = self._raw
        s.inputs_changed.append(
            raw is not None and raw.shape == inputs.shape and not torch.equal(raw.float(), inputs.float())
        )

    @hookimpl
    def after_loss(self, state: State) -> None:
        outputs = state.outputs
        self.seen.output_dtypes.append(outputs.dtype)
        self.seen.losses.append(float(state.loss.detach().float()))
        targets = state.batch[1]
        plain = nn.functional.cross_entropy(outputs.detach().float(), targets) if targets.ndim == 1 else None
        self.seen.plain_losses.append(float(plain) if plain is not None else math.nan)
        self.seen.matmul_precisions.append(torch.get_float32_matmul_precision())

    @hookimpl(trylast=True)
    def before_optimizer_step(self, state: State) -> None:
        grads = [p.grad.detach().float().norm() for p in state.unwrapped_model.parameters() if p.grad is not None]
        if grads and state.world_size == 1:
            self.seen.grad_norms.append(float(torch.stack(grads).norm()))

    @hookimpl
    def after_optimizer_step(self, state: State) -> None:
        self.seen.lrs.append(float(state.optimizer.param_groups[0]["lr"]))
        self.seen.optimizer_steps += 1

    @hookimpl
    def batch_end(self, state: State) -> None:
        self.seen.batches += 1

    @hookimpl
    def eval_batch_start(self, state: State) -> None:
        self.seen.eval_shapes.append(tuple(state.batch[0].shape))


Probe = Callable[[Observed], "str | None"]


# -- one combination ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Combo:
    """Algorithms trained together, with an optimizer, on a model, under a wrap
    (``None``: one process; ``"ddp"``: the engine's DDP; ``"fsdp"``: the plugin)."""

    names: tuple[str, ...]
    optimizer: str = "sgd"
    model: str = "cnn"
    wrap: str | None = None

    @property
    def label(self) -> str:
        parts = ["+".join(self.names) or "none", self.optimizer, self.model]
        if self.wrap:
            parts.append(self.wrap)
        return "/".join(parts)


@dataclass
class Cell:
    """A combination's result: ``works``, ``refused`` (with the one-line reason),
    ``not_applicable`` or ``failed`` (with what went wrong)."""

    outcome: str
    detail: str = ""
    seconds: float = 0.0

    @property
    def text(self) -> str:
        if self.outcome == "works":
            return WORKS
        if self.outcome == "not_applicable":
            return NOT_APPLICABLE + (f": {self.detail}" if self.detail else "")
        if self.outcome == "as_one_process":
            return "as in one process: " + self.detail
        return f"{self.outcome}: {self.detail}"


_INSTALLED: dict[str, Any] = {}


def _installed() -> dict[str, Any]:
    if not _INSTALLED:
        _INSTALLED.update(discover(load=True))
    return _INSTALLED


def load_classes(
    names: Iterable[str] | None = None, extra: Mapping[str, type[Algorithm]] | None = None
) -> dict[str, type[Algorithm]]:
    """The installed algorithms (or those of ``names``) by name, plus ``extra``
    (plugins not installed, e.g. a third party's checkout)."""
    installed = _installed()
    wanted = list(installed) if names is None else list(names)
    classes: dict[str, type[Algorithm]] = {}
    for name in wanted:
        if name in (extra or {}):
            continue
        info = installed.get(name)
        if info is None:
            raise ConfigError(f"compatibility: no installed algorithm {name!r}; installed: {', '.join(installed)}")
        if info.cls is None:
            raise ConfigError(f"compatibility: algorithm {name!r} does not load: {info.error}")
        classes[name] = info.cls  # type: ignore[assignment]
    classes.update(extra or {})
    return dict(sorted(classes.items()))


def load_file_plugin(spec: str) -> type[Algorithm]:
    """``path/to/module.py:Class``: an algorithm from a file that is not installed."""
    path, _, attr = spec.rpartition(":")
    if not path or not attr or not Path(path).is_file():
        raise ConfigError(f"--add {spec!r}: expected PATH/TO/module.py:ClassName of an existing file")
    module_name = Path(path).stem
    spec_obj = importlib.util.spec_from_file_location(module_name, path)
    assert spec_obj is not None and spec_obj.loader is not None
    module = importlib.util.module_from_spec(spec_obj)
    sys.modules[module_name] = module
    try:
        spec_obj.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # a plugin's import may fail in any way
        sys.modules.pop(module_name, None)
        raise ConfigError(f"--add {spec!r}: {path} does not load: {type(exc).__name__}: {_told(exc)}") from None
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise ConfigError(f"--add {spec!r}: {attr} is not a slipstream.Algorithm subclass")
    return cls


def load_plugins(
    names: Sequence[str] | None, add: Sequence[str]
) -> tuple[dict[str, type[Algorithm]], list[str]]:
    """The classes to check (as :func:`load_classes`) and one line per problem that makes
    the matrix meaningless, as a run of the engine would refuse it: a plugin that does not
    load, an ``--add`` class with no name or the name of an installed algorithm (or of
    another ``--add``), a method marked as a hook whose name is no hook or that takes an
    argument its hook does not pass (the engine's own check, ``check_hook_names``)."""
    installed = _installed()
    problems: list[str] = []
    extra: dict[str, type[Algorithm]] = {}
    for spec in add:
        try:
            cls = load_file_plugin(spec)
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        if not isinstance(cls.name, str) or not cls.name:
            problems.append(f"--add {spec!r}: {cls.__name__} has no name; set the class attribute `name`")
        elif cls.name in installed:
            problems.append(
                f"--add {spec!r}: {cls.__name__} is named {cls.name!r}, the name of an installed algorithm "
                f"(distribution {installed[cls.name].distribution}); give it a name of its own"
            )
        elif cls.name in extra:
            problems.append(f"--add {spec!r}: {cls.__name__} is named {cls.name!r}, as another --add is")
        else:
            extra[cls.name] = cls
    wanted = list(installed) if names is None else [n for n in names if n not in extra]
    for name in wanted:
        try:
            found = load_classes([name])
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        extra.update(found)
    for cls in extra.values():
        problem = hook_problem(cls)
        if problem:
            problems.append(problem)
    return dict(sorted(extra.items())), problems


def hook_problem(cls: type[Algorithm]) -> str | None:
    """What the engine refuses at start-up in ``cls``'s hook methods (a name that is no
    hook, an argument the hook does not pass), or None. Checked on an instance made
    without its config (``__init__`` is not run)."""
    from slipstream import hookspecs
    from slipstream.errors import PluginError
    from slipstream.plugins.discovery import check_hook_names
    from slipstream.plugins.dispatch import plugin_manager

    pm = plugin_manager(hookspecs.PROJECT, hookspecs)
    try:
        pm.register(cls.__new__(cls), name=cls.name)
        check_hook_names(pm)
    except PluginError as exc:
        return str(exc)
    return None


def tiny_model(kind: str) -> nn.Module:
    """A seeded tiny timm model: ``cnn`` (test_resnet) or ``vit`` (test_vit, 8 px
    patches, dynamic image size)."""
    from slipstream.models import build_model

    torch.manual_seed(0)
    if kind == "cnn":
        return build_model("test_resnet", NUM_CLASSES, image_size=CNN_IMAGE_SIZE)
    return build_model("test_vit", NUM_CLASSES, image_size=IMAGE_SIZE, patch_size=8)


_DATA: dict[int, Any] = {}


def _datasets(size: int, world_size: int = 1) -> tuple[Any, Any]:
    """Synthetic data of :data:`EPOCH_BATCHES` batches per process and epoch."""
    if (size, world_size) not in _DATA:
        from slipstream.data import build_datasets

        train, val, _ = build_datasets(
            "synthetic", image_size=size, num_classes=NUM_CLASSES,
            train_size=BATCH * EPOCH_BATCHES * world_size, val_size=BATCH, seed=0,
        )
        _DATA[size, world_size] = (train, val)
    return _DATA[size, world_size]


def _build_plugins(
    combo: Combo, classes: Mapping[str, type[Algorithm]], settings: Mapping[str, Mapping[str, Any]]
) -> list[Algorithm]:
    plugins = []
    for name in combo.names:
        cls = classes[name]
        plugins.append(cls(plugin_config(cls, dict(settings.get(name, {})) or None)))
    return plugins


def train_once(
    combo: Combo,
    classes: Mapping[str, type[Algorithm]],
    run_dir: Path,
    *,
    settings: Mapping[str, Mapping[str, Any]] | None = None,
    load: Path | None = None,
    rank: int = 0,
    world_size: int = 1,
    resumable: bool = True,
    batches: int = BATCHES,
) -> Observed:
    """Train ``combo`` for :data:`BATCHES` batches, two epochs (a checkpoint after batch
    :data:`RESUME_AT`, evaluated at the end), or resume it from ``load``. Not
    ``resumable``: one checkpoint at the end, latest.pt alone (every plugin's state is
    still saved once; the mid-run files only serve a resume). Raises what set-up or the run raises."""
    from slipstream.data import build_loader
    from slipstream.optim import build_optimizer
    from slipstream.trainer import Trainer

    settings = settings or {}
    # Each run compiles afresh: the last run's graphs would count against dynamo's
    # recompile limit, and past it the model would silently run uncompiled.
    torch._dynamo.reset()
    train, val = _datasets(CNN_IMAGE_SIZE if combo.model == "cnn" else IMAGE_SIZE, world_size)
    model = tiny_model(combo.model)
    optimizer = build_optimizer(model, combo.optimizer, 0.05 if combo.optimizer == "sgd" else 1e-3)
    plugins = _build_plugins(combo, classes, settings)
    seen = Observed(plugins=plugins)
    seen.initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer = Trainer(
        model=model,
        optimizer=optimizer,
        train_data=build_loader(train, batch_size=BATCH, seed=0, rank=rank, world_size=world_size),
        eval_data=build_loader(val, batch_size=BATCH, shuffle=False, drop_last=False, rank=rank,
                               world_size=world_size),
        max_duration=f"{batches}ba",
        algorithms=plugins,
        run_dir=run_dir,
        eval_interval=f"{batches}ba",
        log_interval=batches,
        checkpoint_interval=f"{RESUME_AT if resumable else batches}ba",
        checkpoint_keep=4 if resumable else 0,
        best_metric=None,
        load_path=load,
        progress_bar=False,
        verbose=False,
        device="cpu",
        threads=1,  # tiny tensors: more threads only contend
        # Each plugin's default variant (the effect the probes look for), not a timed
        # choice: the matrix checks how plugins combine, and timing 4-batch runs on
        # a shared machine would make the cells depend on its load.
        autotune=False,
        installed=_installed(),
    )
    trainer.pm.register(_Recorder(seen, trainer.normalize), name=_Recorder.name)
    with warnings.catch_warnings(), _quick():
        warnings.simplefilter("ignore")
        trainer.fit()
    seen.model = trainer.state.unwrapped_model
    seen.wrapped = trainer.state.model
    if world_size == 1:
        seen.final = {k: v.detach().clone() for k, v in seen.model.state_dict().items()}
    seen.summary = dict(trainer.summary)
    return seen


@contextlib.contextmanager
def _quick() -> Iterator[None]:
    """Leave out what costs a tiny run more than its training and that no cell
    depends on: the FLOP count (MFU), the collector pass before the memory peak, and
    the fsyncs that make checkpoints durable across a power cut."""
    from unittest import mock

    with (
        mock.patch("slipstream.services.utilization.training_flops_per_sample", return_value=0.0),
        mock.patch("slipstream.services.memory.gc.collect", return_value=0),
        mock.patch("slipstream.run.directory.os.fsync"),
    ):
        yield


def _latest_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from slipstream.run.checkpoint import load_checkpoint

    return load_checkpoint(run_dir / "checkpoints" / "latest.pt")["model"]


def _mid_checkpoint(run_dir: Path) -> Path:
    from slipstream.run.directory import RunDir

    return RunDir(run_dir).checkpoint(1, RESUME_AT)  # epoch 1


def check_combo(
    combo: Combo,
    classes: Mapping[str, type[Algorithm]],
    workdir: Path,
    *,
    settings: Mapping[str, Mapping[str, Any]] | None = None,
    probes: Mapping[str, Probe] | None = None,
    resume: bool = True,
    rank: int = 0,
    world_size: int = 1,
    batches: int = BATCHES,
) -> Cell:
    """Train ``combo``, look for each plugin's effect, resume it from its mid-run
    checkpoint and compare: the cell of the table. ``batches``: how many to train
    when not resuming (the resume check needs :data:`BATCHES`)."""
    started = time.perf_counter()
    run_dir = workdir / combo.label.replace("/", "_")
    if rank == 0 and run_dir.exists():
        shutil.rmtree(run_dir)
    _barrier(world_size)  # no rank looks at the run directory before it is gone
    try:
        seen = train_once(combo, classes, run_dir, settings=settings, rank=rank, world_size=world_size,
                          resumable=resume, batches=BATCHES if resume else batches)
    except SlipstreamError as exc:
        reason = first_line(exc)
        if (run_dir / "summary.json").exists():  # the run began: an error of a plugin's, mid-run
            return Cell("failed", _told(exc, named=True), _since(started))
        if run_dir.exists() and any(run_dir.iterdir()):
            return Cell("failed", f"refused after writing {run_dir.name}: {reason}", _since(started))
        return Cell("refused", reason, _since(started))
    except Exception as exc:  # any crash is a finding, reported in its cell
        return Cell("failed", _told(exc, named=True), _since(started))
    status = seen.summary.get("status")
    if status != "completed":
        return Cell("failed", f"status {status!r} after {seen.batches} batches", _since(started))
    if not seen.losses or not all(math.isfinite(v) for v in seen.losses):
        return Cell("failed", f"non-finite losses {seen.losses}", _since(started))
    for name in combo.names:
        probe = (probes or {}).get(name)
        missing = probe(seen) if probe else None
        if missing:
            return Cell("failed", f"{name} shows no effect: {missing}", _since(started))
    if resume:
        resumed_dir = run_dir.with_name(run_dir.name + "_resumed")
        if rank == 0 and resumed_dir.exists():
            shutil.rmtree(resumed_dir)
        _barrier(world_size)
        try:
            again_seen = train_once(combo, classes, resumed_dir, settings=settings,
                                    load=_mid_checkpoint(run_dir), rank=rank, world_size=world_size)
        except Exception as exc:
            return Cell("failed", f"resume: {_told(exc, named=True)}", _since(started))
        if rank == 0:
            if world_size == 1:
                straight, again = seen.final, again_seen.final
            else:  # sharded in memory: the full weights rank 0 wrote
                straight, again = _latest_weights(run_dir), _latest_weights(resumed_dir)
            differ = [k for k in straight if not torch.equal(straight[k], again[k])]
            if differ:
                return Cell("failed", f"resume from batch {RESUME_AT} (epoch 1) differs in {len(differ)} tensors "
                                      f"(first {differ[0]})", _since(started))
    return Cell("works", "", _since(started))


def _barrier(world_size: int) -> None:
    if world_size > 1 and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _since(start: float) -> float:
    return round(time.perf_counter() - start, 2)


def _told(exc: BaseException, named: bool = False) -> str:
    """The first line of ``exc``'s message; ``named``: as ``TYPE: message`` (a
    SlipstreamError as its message), after the plugin and hook that raised it."""
    text, line = str(exc).strip(), first_line(exc)
    if named:
        where = raised_in(exc)
        line = line if isinstance(exc, SlipstreamError) and text else f"{type(exc).__name__}: {line}"
        line = f"{where}: {line}" if where else line
    return line[:300]


# -- the matrix --------------------------------------------------------------------------------


@dataclass
class Matrix:
    """Every cell, by :class:`Combo`."""

    names: list[str]
    five: tuple[str, ...]
    cells: dict[Combo, Cell] = field(default_factory=dict)
    classes: dict[str, type[Algorithm]] = field(default_factory=dict, repr=False)
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)

    def single(self, name: str) -> dict[str, Cell]:
        return {kind: self.cells[Combo((name,), model=kind)] for kind in MODELS}

    def models_for(self, name: str) -> list[str]:
        return [kind for kind, cell in self.single(name).items() if cell.outcome == "works"]


def single_combos(names: Sequence[str]) -> list[Combo]:
    return [Combo((n,), model=kind) for n in names if n != WRAP_PLUGIN for kind in MODELS]


def pair_model(matrix: Matrix, a: str, b: str) -> str | None:
    """The tiny model a pair trains on: the CNN when both apply to it, else the ViT."""
    both = [k for k in MODELS if k in matrix.models_for(a) and k in matrix.models_for(b)]
    return both[0] if both else None


PARTS = ("singles", "optimizers", "pairs", "five")


def run_local(
    classes: Mapping[str, type[Algorithm]],
    workdir: Path,
    *,
    five: Sequence[str] = (),
    settings: Mapping[str, Mapping[str, Any]] | None = None,
    probes: Mapping[str, Probe] | None = None,
    progress: Callable[[Combo, Cell], None] | None = None,
    parts: Sequence[str] = PARTS,
    resume: Callable[[Combo], bool] | None = None,
    batches: int = BATCHES,
) -> Matrix:
    """The one-process part: each plugin alone on both models and with each
    optimizer, every pair, the five together (``parts`` chooses; the singles always
    run, since they say which model each plugin applies to, but are only probed and
    resumed when asked for). ``resume`` says which combinations get the resume check
    (default: all); the others train ``batches``. A wrap plugin (fsdp) is left to :func:`run_distributed`."""
    names = list(classes)
    matrix = Matrix(names, tuple(n for n in five if n in classes),
                    settings={k: dict(v) for k, v in (settings or {}).items()}, classes=dict(classes))

    def do(combo: Combo, checked: bool = True) -> Cell:
        cell = check_combo(combo, classes, workdir, settings=settings, probes=probes if checked else None,
                           resume=checked and (resume is None or resume(combo)), batches=batches)
        matrix.cells[combo] = cell
        if progress:
            progress(combo, cell)
        return cell

    for combo in single_combos(names):
        do(combo, checked="singles" in parts)
    local = [n for n in names if n != WRAP_PLUGIN]
    if "optimizers" in parts:
        for name in local:
            models = matrix.models_for(name)
            for opt in OPTIMIZERS[1:]:
                if models:
                    do(Combo((name,), optimizer=opt, model=models[0]))
    if "pairs" in parts:
        for a, b in itertools.combinations(local, 2):
            kind = pair_model(matrix, a, b)
            if kind is not None:
                do(Combo((a, b), model=kind))
    if "five" in parts and len(matrix.five) > 1:
        do(Combo(matrix.five, model="cnn"))
    return matrix


# Where a wrap can change what a plugin does: it touches the model or optimizer before
# the wrap (init), a step the wrap takes part in, the gradients the wrap reduces, or
# the state it shards. A plugin with none of these acts on the batches, the loss or
# the LR alone, the same on every rank as in one process.
WRAP_HOOKS = frozenset({
    "init", "forward", "backward", "should_step", "optimizer_step", "wrap_model", "state_dicts",
    "load_state_dicts", "after_backward", "before_optimizer_step", "after_optimizer_step",
})


def wrap_hooks(cls: type[Algorithm]) -> list[str]:
    """The :data:`WRAP_HOOKS` that ``cls`` implements."""
    return sorted(h for h in WRAP_HOOKS if hasattr(getattr(cls, h, None), "slipstream_impl"))


def distributed_combos(matrix: Matrix) -> list[Combo]:
    """Under 2-process DDP: each plugin alone and the five; under fsdp: fsdp alone,
    with each plugin, and with the five."""
    combos: list[Combo] = []
    local = [n for n in matrix.names if n != WRAP_PLUGIN and wrap_hooks(matrix.classes[n])]
    for name in local:
        models = matrix.models_for(name)
        if models:
            combos.append(Combo((name,), model=models[0], wrap="ddp"))
    if len(matrix.five) > 1:
        combos.append(Combo(matrix.five, model="cnn", wrap="ddp"))
    if WRAP_PLUGIN in matrix.names:
        combos.append(Combo((WRAP_PLUGIN,), model="cnn", wrap="fsdp"))
        combos.append(Combo((WRAP_PLUGIN,), model="vit", wrap="fsdp"))
        for name in local:
            models = matrix.models_for(name)
            if models:
                combos.append(Combo((name, WRAP_PLUGIN), model=models[0], wrap="fsdp"))
        if len(matrix.five) > 1:
            combos.append(Combo((*matrix.five, WRAP_PLUGIN), model="cnn", wrap="fsdp"))
    return combos


def run_distributed(
    matrix: Matrix,
    workdir: Path,
    *,
    extra: Sequence[str] = (),
    timeout: float = 900,
    progress: Callable[[Combo, Cell], None] | None = None,
    resume: Callable[[Combo], bool] | None = None,
    batches: int = BATCHES,
) -> None:
    """Run :func:`distributed_combos` in one 2-process gloo launch (torchrun) and put
    their cells in ``matrix``. ``extra`` are ``--add`` specs the ranks load too; the
    combinations without the resume check train ``batches``."""
    import socket
    import subprocess

    combos = distributed_combos(matrix)
    spec = {
        "combos": [[list(c.names), c.optimizer, c.model, c.wrap] for c in combos],
        "resume": [resume is None or resume(c) for c in combos],
        "batches": batches,
        "settings": matrix.settings,
        "extra": list(extra),
        "names": matrix.names,
        "workdir": str(workdir),
    }
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "distributed.json"
    spec_path.write_text(json.dumps(spec))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
         f"--master_port={port}", "-m", "slipstream.cli.compatibility", str(spec_path)],
        capture_output=True, text=True, timeout=timeout, env=env,
    )
    out = workdir / "distributed.results.json"
    if result.returncode != 0 or not out.exists():
        tail = (result.stderr or result.stdout)[-2000:]
        for combo in combos:
            last = tail.splitlines()[-1] if tail else "?"
            matrix.cells[combo] = Cell("failed", f"the 2-process launch failed: {last}")
        return
    for names, opt, model, wrap, cell in json.loads(out.read_text()):
        combo = Combo(tuple(names), opt, model, wrap)
        matrix.cells[combo] = Cell(**cell)
        if progress:
            progress(combo, matrix.cells[combo])


def _rank_main(spec_path: str) -> None:
    """One rank of :func:`run_distributed`'s launch."""
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    extra = {}
    for item in spec["extra"]:
        cls = load_file_plugin(item)
        extra[cls.name] = cls
    classes = load_classes([n for n in spec["names"] if n not in extra], extra)
    workdir = Path(spec["workdir"]) / "distributed"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = []
    for i, (names, opt, model, wrap) in enumerate(spec["combos"]):
        combo = Combo(tuple(names), opt, model, wrap)
        resume = spec.get("resume", [True] * len(spec["combos"]))[i]
        cell = check_combo(combo, classes, workdir, settings=spec["settings"], rank=rank, world_size=world,
                           resume=resume, batches=spec.get("batches", BATCHES))
        # Every rank must agree; a rank's failure is the cell's.
        cells: list[Any] = [None] * world
        dist.all_gather_object(cells, cell.__dict__)
        worst = next((c for c in cells if c["outcome"] == "failed"), cells[0])
        results.append([names, opt, model, wrap, worst])
    if rank == 0:
        Path(spec_path).with_name("distributed.results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


# -- the table ---------------------------------------------------------------------------------


def _cell_text(cell: Cell | None) -> str:
    if cell is None:
        return ""
    text = cell.text
    return text.replace("|", "\\|")


def _short(cell: Cell | None) -> str:
    """A pair-grid entry: ✓, refused, n/a, FAILED (reasons listed below the grid)."""
    if cell is None:
        return ""
    return {"works": "✓", "refused": "refused", "not_applicable": "n/a", "failed": "FAILED",
            "as_one_process": "✓ (1)"}[cell.outcome]


def render(matrix: Matrix, command: str) -> str:
    """docs/compatibility.md: how it was made, the pair grid, the reasons, each plugin
    alone (both models, each optimizer, DDP, fsdp), the five together."""
    names = matrix.names
    local = [n for n in names if n != WRAP_PLUGIN]
    lines = [
        "# Compatibility matrix",
        "",
        "Generated by `slipstream compatibility`; do not edit by hand. Regenerate with:",
        "",
        "```",
        command,
        "```",
        "",
        f"Each combination trains {BATCHES} batches of {BATCH} synthetic images (two epochs of {EPOCH_BATCHES} "
        "batches per process) on a tiny timm model "
        f"(`test_resnet` at {CNN_IMAGE_SIZE} px, the CNN, or `test_vit` at {IMAGE_SIZE} px, the ViT), "
        "on the CPU, seeded, with `trainer.autotune` off (each plugin runs its default variant). It **works** when "
        "the losses are finite, each plugin's probe sees its effect (the test suite's probes: autocast "
        "dtype, channels-last inputs, LR moving within the epoch, input size, augmented batch, ...), and "
        f"the checkpoint taken after batch {RESUME_AT}, in the second epoch, resumes to the same final weights bit "
        "for bit (so state a plugin carries across an epoch boundary must be in its checkpoint). **refused** is "
        "a start-up refusal declared by a plugin, in one line, before anything is written (exit 2). "
        "**n/a**: no tiny model suits both (a plugin that refuses a model does not apply to it). "
        "A pair is trained on the CNN when both apply to it, otherwise on the ViT. "
        "DDP and fsdp cells ran in one 2-process gloo launch.",
        "",
    ]
    if matrix.settings:
        lines += ["Options given for these short runs:", ""]
        for name, options in sorted(matrix.settings.items()):
            for key, value in sorted(options.items()):
                lines.append(f"- `algorithms.{name}.{key}={json.dumps(value)}`")
        lines.append("")
    lines += ["## Every pair", ""]
    header = "| | " + " | ".join(f"`{n}`" for n in names) + " |"
    lines += [header, "|---" * (len(names) + 1) + "|"]
    notes: list[str] = []
    for a in names:
        row = [f"`{a}`"]
        for b in names:
            if a == b:
                row.append("—")
                continue
            cell = pair_cell(matrix, a, b)
            row.append(_short(cell))
            if cell is not None and cell.outcome not in ("works", "as_one_process") and names.index(a) < names.index(b):
                notes.append(f"- `{a}` + `{b}`: {_cell_text(cell)}")
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "✓ (1): as in one process: the plugin has no hook where the wrap matters "
              f"({', '.join(sorted(WRAP_HOOKS))}), so it was not run again under it.", ""]
    if notes:
        lines += ["Pairs that do not simply work:", "", *notes, ""]
    lines += [
        "## Each plugin alone, with each optimizer and wrap",
        "",
        "| plugin | CNN | ViT | adamw | adafactor | 2-process DDP | fsdp (2 processes) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in local:
        single = matrix.single(name)
        models = matrix.models_for(name)
        kind = models[0] if models else None
        opts = [
            _cell_text(matrix.cells.get(Combo((name,), optimizer=o, model=kind))) if kind else ""
            for o in OPTIMIZERS[1:]
        ]
        ddp = _cell_text(wrapped_cell(matrix, name, "ddp")) if kind else ""
        fsdp = wrapped_cell(matrix, name, WRAP_PLUGIN) if WRAP_PLUGIN in names else None
        lines.append(
            f"| `{name}` | {_cell_text(single['cnn'])} | {_cell_text(single['vit'])} | "
            + " | ".join(opts) + f" | {ddp} | {_cell_text(fsdp)} |"
        )
    if WRAP_PLUGIN in names:
        fs = [_cell_text(matrix.cells.get(Combo((WRAP_PLUGIN,), model=k, wrap="fsdp"))) for k in MODELS]
        lines.append(f"| `{WRAP_PLUGIN}` | {fs[0]} | {fs[1]} | | | | (itself) |")
    lines.append("")
    if len(matrix.five) > 1:
        lines += [
            "## The five design-card algorithms together",
            "",
            f"`{','.join(matrix.five)}` on the CNN:",
            "",
            "| one process | 2-process DDP | fsdp (2 processes) |",
            "|---|---|---|",
            "| " + " | ".join(
                _cell_text(matrix.cells.get(c)) for c in (
                    Combo(matrix.five, model="cnn"),
                    Combo(matrix.five, model="cnn", wrap="ddp"),
                    Combo((*matrix.five, WRAP_PLUGIN), model="cnn", wrap="fsdp"),
                )
            ) + " |",
            "",
        ]
    cells = {c.label: [cell.outcome, cell.detail] for c, cell in matrix.cells.items()}
    lines += ["<!-- the cells, for tests and tools:", json.dumps(cells, indent=0, sort_keys=True), "-->", ""]
    return "\n".join(lines)


def cells_of(text: str) -> dict[str, list[str]]:
    """The cells a table written by :func:`render` records, by combination label."""
    start = text.index("<!-- the cells, for tests and tools:")
    body = text[start:].split("\n", 1)[1].rsplit("-->", 1)[0]
    return json.loads(body)


def from_cells(
    cells: Mapping[str, Sequence[str]],
    classes: Mapping[str, type[Algorithm]],
    five: Sequence[str],
    settings: Mapping[str, Mapping[str, Any]] | None = None,
) -> Matrix:
    """A :class:`Matrix` from recorded cells (the record :func:`render` writes)."""
    matrix = Matrix(list(classes), tuple(n for n in five if n in classes),
                    settings={k: dict(v) for k, v in (settings or {}).items()}, classes=dict(classes))
    for label, (outcome, detail) in cells.items():
        parts = label.split("/")
        combo = Combo(tuple(parts[0].split("+")), parts[1], parts[2], parts[3] if len(parts) > 3 else None)
        matrix.cells[combo] = Cell(outcome, detail)
    return matrix


def wrapped_cell(matrix: Matrix, name: str, wrap: str) -> Cell | None:
    """``name`` alone under ``wrap`` (with fsdp: fsdp and ``name``)."""
    models = matrix.models_for(name)
    if not models:
        return _failed_alone(matrix, name) or Cell("not_applicable", f"{name} applies to no tiny model")
    if name in matrix.classes and not wrap_hooks(matrix.classes[name]):
        return Cell("as_one_process", "no hook where a wrap matters (it acts on batches, the loss or the LR)")
    names = (name,) if wrap == "ddp" else (name, WRAP_PLUGIN)
    return matrix.cells.get(Combo(names, model=models[0], wrap=wrap))


def pair_cell(matrix: Matrix, a: str, b: str) -> Cell | None:
    """The cell of ``a`` with ``b`` (either order)."""
    if WRAP_PLUGIN in (a, b):
        return wrapped_cell(matrix, b if a == WRAP_PLUGIN else a, "fsdp")
    kind = pair_model(matrix, a, b)
    if kind is None:
        uses = "; ".join(f"{n}: {', '.join(matrix.models_for(n)) or 'none'}" for n in (a, b))
        return _failed_alone(matrix, a, b) or Cell("not_applicable", f"no tiny model suits both ({uses})")
    for names in ((a, b), (b, a)):
        cell = matrix.cells.get(Combo(names, model=kind))
        if cell is not None:
            return cell
    return None


def _failed_alone(matrix: Matrix, *names: str) -> Cell | None:
    """A failure for a combination not tried because one of ``names`` failed on its own
    (not "does not apply": that is a plugin's declared refusal of a model)."""
    broken = [n for n in names if any(c.outcome == "failed" for c in matrix.single(n).values())]
    if not broken:
        return None
    return Cell("failed", f"{' and '.join(broken)} failed on its own, so this was not tried")


def failures(matrix: Matrix) -> dict[str, Cell]:
    return {c.label: cell for c, cell in matrix.cells.items() if cell.outcome == "failed"}


def parse_settings(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``algorithms.NAME.KEY=VALUE`` (VALUE as YAML) into ``{NAME: {KEY: VALUE}}``."""
    import yaml

    settings: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        parts = key.split(".")
        if not sep or len(parts) != 3 or parts[0] != "algorithms":
            raise ConfigError(f"--set {item!r}: expected algorithms.NAME.KEY=VALUE")
        settings.setdefault(parts[1], {})[parts[2]] = yaml.safe_load(value)
    return settings


def run_matrix(
    classes: Mapping[str, type[Algorithm]],
    *,
    five: Sequence[str] = (),
    settings: Mapping[str, Mapping[str, Any]] | None = None,
    probes: Mapping[str, Probe] | None = None,
    extra: Sequence[str] = (),
    distributed: bool = True,
    workdir: Path | None = None,
    progress: Callable[[Combo, Cell], None] | None = None,
) -> Matrix:
    """The whole matrix: :func:`run_local`, then :func:`run_distributed`."""
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="slipstream-compat-")))
        matrix = run_local(classes, workdir, five=five, settings=settings, probes=probes, progress=progress)
        if distributed and torch.distributed.is_available():
            run_distributed(matrix, workdir, extra=extra, progress=progress)
    return matrix


def command_line(
    *,
    together: Sequence[str] = (),
    settings: Mapping[str, Mapping[str, Any]] | None = None,
    add: Sequence[str] = (),
    algorithms: Sequence[str] | None = None,
    distributed: bool = True,
    out: str = "docs/compatibility.md",
) -> str:
    """The command that regenerates a table, as its header shows it."""
    parts = ["slipstream compatibility"]
    if algorithms:
        parts.append(f"--algorithms {','.join(algorithms)}")
    parts += [f"--add {a}" for a in add]
    if together:
        parts.append(f"--together {','.join(together)}")
    for name, options in sorted((settings or {}).items()):
        parts += [f"--set algorithms.{name}.{k}={json.dumps(v)}" for k, v in sorted(options.items())]
    if not distributed:
        parts.append("--no-distributed")
    parts.append(f"--out {out}")
    return " \\\n    ".join(parts)


def compatibility_command(
    *,
    out: Path | None,
    check: bool,
    algorithms: str | None,
    add: Sequence[str],
    together: str,
    settings: Sequence[str],
    distributed: bool,
) -> int:
    """``slipstream compatibility``: run the matrix, print each cell as it comes
    (stderr), write or check the table. Exit 1 when a cell failed or, with
    ``--check``, when the table differs from ``out``."""
    if check and out is None:
        raise ConfigError("--check compares with --out PATH; give the table's path")
    parsed = parse_settings(settings)
    names = [n for n in algorithms.split(",") if n] if algorithms else None
    classes, problems = load_plugins(names, add)
    if problems:
        for problem in problems:
            print(f"slipstream: error: {problem}", file=sys.stderr)
        return 2
    five = [n for n in together.split(",") if n]
    unknown = [n for n in [*five, *parsed] if n not in classes]
    if unknown:
        raise ConfigError(f"--together/--set name {', '.join(unknown)}, not among: {', '.join(classes)}")

    def progress(combo: Combo, cell: Cell) -> None:
        print(f"{combo.label}: {cell.text} ({cell.seconds:.1f} s)", file=sys.stderr, flush=True)

    matrix = run_matrix(classes, five=five, settings=parsed, extra=list(add), distributed=distributed,
                        progress=progress)
    text = render(matrix, command_line(together=five, settings=parsed, add=add, algorithms=names,
                                       distributed=distributed, out=str(out or "docs/compatibility.md")))
    failed = failures(matrix)
    for label, cell in failed.items():
        print(f"slipstream: {label} failed: {cell.detail}", file=sys.stderr)
    if check:
        assert out is not None
        current = out.read_text() if out.is_file() else ""
        if current != text:
            print(f"slipstream: {out} is not current; regenerate it with the command in its header",
                  file=sys.stderr)
            return 1
        print(f"slipstream: {out} is current", file=sys.stderr)
    elif out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"slipstream: wrote {out}", file=sys.stderr)
    else:
        print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    with contextlib.redirect_stdout(io.StringIO()):
        _rank_main(sys.argv[1])
