"""Activation checkpointing: keep only the inputs of the model's repeated blocks in the
forward pass and recompute the rest in backward, trading compute for memory.

Two paths:

* **timm** — timm models checkpoint their own blocks with
  ``model.set_grad_checkpointing(True)``.
* **modules** — any other model: the chosen blocks' ``forward`` is wrapped, on the
  instance, in ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. Nothing
  is re-parented, so ``state_dict()`` keys stay exactly the same (unlike torch's
  ``checkpoint_wrapper``, which adds ``_checkpoint_wrapped_module.`` to every key), and a
  ``copy.deepcopy`` of the model (an EMA copy) is checkpointed the same way.

The recomputation runs BatchNorm a second time in training mode; on the modules path
the running statistics it would update twice are put back after the recomputation.
"""

from __future__ import annotations

import types
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from slipstream import Algorithm, ConfigError, State, check_plugin_options, hookimpl, plugin_option

MODES = ("auto", "timm", "modules")
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_INNER = "_checkpointed_inner_forward"  # the instance attribute holding the original forward


# -- the modules path ---------------------------------------------------------------------------


@contextmanager
def _keep_running_stats(module: nn.Module) -> Iterator[None]:
    """Undo what a recomputed forward does to running statistics (BatchNorm's
    running_mean/var and num_batches_tracked), which the first forward already updated."""
    norms = [
        m for m in module.modules()
        if m.training and isinstance(getattr(m, "running_mean", None), torch.Tensor)
    ]
    saved = [[b.clone() for b in m.buffers(recurse=False)] for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, buffers in zip(norms, saved, strict=True):
                for b, old in zip(m.buffers(recurse=False), buffers, strict=True):
                    b.copy_(old)


def _recompute_contexts(module: nn.Module) -> tuple[Any, Any]:
    return nullcontext(), _keep_running_stats(module)


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    inner = getattr(self, _INNER)
    if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
        return inner(*args, **kwargs)
    if torch.compiler.is_compiling():
        # Compiled graphs take no custom contexts, and apply buffer updates once anyway.
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)
    contexts = partial(_recompute_contexts, self)
    return checkpoint(inner, *args, use_reentrant=False, context_fn=contexts, **kwargs)


def checkpoint_module(module: nn.Module) -> None:
    """Recompute ``module``'s activations in backward (idempotent).

    The instance's ``forward`` becomes a bound method that runs the original one under
    ``torch.utils.checkpoint``; parameters and their names are untouched.
    """
    if _INNER in vars(module):
        return
    # Bound methods (not closures), so that copy.deepcopy rebinds both to the copy.
    setattr(module, _INNER, module.forward)
    module.forward = types.MethodType(_checkpointed_forward, module)


def uncheckpoint_module(module: nn.Module) -> None:
    """Undo :func:`checkpoint_module`: the module's own ``forward`` again."""
    if _INNER in vars(module):
        del module.forward
        delattr(module, _INNER)


def remove_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Undo both paths in place (timm's flag and wrapped forwards); returns ``model``."""
    if _has_timm_checkpointing(model):
        try:
            model.set_grad_checkpointing(False)
        except (AssertionError, NotImplementedError):  # timm's "not supported"
            pass
    for module in model.modules():
        uncheckpoint_module(module)
    return model


def checkpointed_modules(model: nn.Module) -> list[str]:
    """Names of the submodules of ``model`` wrapped by :func:`checkpoint_module`."""
    return [name for name, m in model.named_modules() if _INNER in vars(m)]


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _is_block(module: nn.Module) -> bool:
    # A block has parts and weights; a bare layer (Conv2d, ReLU) gains nothing alone,
    # and an in-place activation checkpointed alone would overwrite its saved input.
    has_parts = next(module.children(), None) is not None
    return not isinstance(module, _CONTAINERS) and has_parts and _params(module) > 0


def find_repeated_blocks(model: nn.Module) -> list[str]:
    """The blocks to checkpoint when none are named.

    Blocks are modules with parts and weights held in an ``nn.Sequential``/``ModuleList``;
    those whose containers belong to the same module form a group (``layer1`` …
    ``layer4`` of a ResNet belong to the ResNet, ``blocks`` to a ViT), and the group with
    the most parameters, of at least two blocks, is chosen: ``blocks.0`` … of a timm ViT,
    ``layer1.0`` … ``layer4.1`` of a torchvision ResNet, ``encoder.layers.*`` of its ViT.
    """
    owner_of = {id(child): parent for parent in model.modules() for child in parent.children()}
    groups: dict[int, list[tuple[str, nn.Module]]] = defaultdict(list)
    for name, container in model.named_modules():
        if isinstance(container, _CONTAINERS):
            key = id(owner_of.get(id(container)))
            for child_name, child in container.named_children():
                if _is_block(child):
                    groups[key].append((f"{name}.{child_name}" if name else child_name, child))
    repeated = [group for group in groups.values() if len(group) >= 2]
    if not repeated:
        raise ValueError(
            f"found no repeated blocks (two or more modules with weights inside an nn.Sequential "
            f"or nn.ModuleList) in {type(model).__name__}; name the modules to checkpoint; "
            f"its children are: {_children(model)}"
        )
    best = max(repeated, key=lambda group: (sum(_params(m) for _, m in group), len(group)))
    return _outermost([name for name, _ in best])


def _outermost(names: Sequence[str]) -> list[str]:
    """Drop modules nested inside another chosen one: a checkpoint inside a checkpoint
    only recomputes twice."""
    return [n for n in names if not any(n.startswith(other + ".") for other in names if other != n)]


def _children(module: nn.Module) -> str:
    return ", ".join(name for name, _ in module.named_children()) or "none"


def _unknown(model: nn.Module, spec: str) -> str:
    named = dict(model.named_modules())
    parent_path = spec.rsplit(".", 1)[0] if "." in spec else ""
    while parent_path and parent_path not in named:
        parent_path = parent_path.rsplit(".", 1)[0] if "." in parent_path else ""
    where = f"{parent_path!r}" if parent_path else type(model).__name__
    classes = sorted({type(m).__name__ for n, m in named.items() if n and _is_block(m)})
    return (
        f"{spec!r} is neither a submodule nor a module class of {type(model).__name__}; "
        f"the children of {where} are: {_children(named[parent_path])}"
        + (f"; block classes: {', '.join(classes)}" if classes else "")
    )


def resolve_modules(model: nn.Module, modules: Sequence[str]) -> list[str]:
    """Names of the submodules that ``modules`` selects, in the model's order: each entry
    is a dotted path (``blocks``, ``layer1``, ``encoder.layers.0``) or a class name
    (``BasicBlock``). A path to an ``nn.Sequential``/``ModuleList`` selects those of its
    children that have weights and parts (a bare ReLU gains nothing on its own)."""
    named = dict(model.named_modules())
    chosen: list[str] = []
    for spec in modules:
        if spec in named and spec:
            module = named[spec]
            if isinstance(module, _CONTAINERS):
                chosen += [f"{spec}.{n}" for n, c in module.named_children() if _is_block(c)]
            else:
                chosen.append(spec)
        else:
            of_class = [n for n, m in named.items() if n and type(m).__name__ == spec]
            if not of_class:
                raise ValueError(_unknown(model, spec))
            chosen += of_class
    order = {name: i for i, name in enumerate(named)}
    return _outermost(sorted(set(chosen), key=order.__getitem__))


def apply_activation_checkpointing(
    model: nn.Module, modules: Sequence[str] | None = None
) -> list[str]:
    """Checkpoint the activations of ``model``'s blocks with ``torch.utils.checkpoint``;
    returns the names of the wrapped modules.

    ``modules`` names them (see :func:`resolve_modules`); ``None`` finds the repeated
    blocks (see :func:`find_repeated_blocks`). Raises ``ValueError`` for a name that
    matches nothing, listing what exists. ``state_dict()`` keys do not change.
    """
    names = find_repeated_blocks(model) if modules is None else resolve_modules(model, modules)
    named = dict(model.named_modules())
    for name in names:
        checkpoint_module(named[name])
    return names


# -- the plugin -------------------------------------------------------------------------------


@dataclass
class ActivationCheckpointingConfig:
    mode: str = plugin_option("auto", choices=MODES)  # auto: timm's own when the model has it, else modules
    modules: Optional[list[str]] = None  # dotted paths or class names; None: the repeated blocks

    def __post_init__(self) -> None:
        check_plugin_options(self)
        if self.modules is not None:
            if not self.modules or not all(isinstance(m, str) and m.strip() for m in self.modules):
                raise ValueError(
                    "modules must be a non-empty list of module paths or class names (e.g. "
                    f"['blocks'] or ['BasicBlock']), or null to find them; got {self.modules!r}"
                )
            if self.mode == "timm":
                raise ValueError(
                    "modules cannot be combined with mode 'timm' (timm chooses its own blocks); "
                    "use mode 'modules' or 'auto'"
                )


def _has_timm_checkpointing(model: nn.Module) -> bool:
    return callable(getattr(model, "set_grad_checkpointing", None))


class ActivationCheckpointing(Algorithm):
    """Recompute the activations of the model's blocks in backward: less memory, more compute."""

    name = "activation_checkpointing"
    config_class = ActivationCheckpointingConfig
    runs_after = ("locality_ffn",)  # checkpoint the final blocks
    runs_before = ("torch_compile",)

    def __init__(self, config: ActivationCheckpointingConfig | None = None) -> None:
        super().__init__(config)
        self.path: str | None = None  # "timm" or "modules", once applied
        self.wrapped: list[str] = []

    @hookimpl
    def init(self, state: State) -> None:
        model, cfg = state.unwrapped_model, self.config
        key = "algorithms.activation_checkpointing"
        # timm checkpoints a ResNet's stages as one sequence, whose recompute in backward
        # runs outside FSDP2's unsharding of each stage: the convolutions meet sharded
        # DTensor weights and the run crashes at the first backward (compatibility
        # matrix, torch 2.14). Checkpointing each block as a module of its own works.
        sharded = any(a.name == "fsdp" for a in state.algorithms)
        if sharded and cfg.mode == "timm":
            raise ConfigError(
                f"{key}.mode=timm cannot run with fsdp: timm's checkpointing may recompute several "
                "FSDP2 units at once, outside their unsharding (a crash in backward); use mode auto "
                "or modules, which checkpoint each block"
            )
        auto_timm = (
            cfg.mode == "auto" and cfg.modules is None and _has_timm_checkpointing(model) and not sharded
        )
        if cfg.mode == "timm" or auto_timm:
            if not _has_timm_checkpointing(model):
                raise ConfigError(
                    f"{key}.mode: 'timm' needs a model with set_grad_checkpointing (a timm model); "
                    f"{type(model).__name__} has none: use mode 'modules' or 'auto'"
                )
            try:
                model.set_grad_checkpointing(True)
                self.path = "timm"
            except (AssertionError, NotImplementedError) as exc:  # timm's "not supported"
                if cfg.mode == "timm":
                    raise ConfigError(
                        f"{key}.mode: {type(model).__name__} cannot checkpoint with timm: {exc}"
                    ) from None
        if self.path is None:
            try:
                self.wrapped = apply_activation_checkpointing(model, cfg.modules)
            except ValueError as exc:
                raise ConfigError(f"{key}.modules: {exc}") from None
            self.path = "modules"
        state.summary["activation_checkpointing"] = {"path": self.path, "modules": self.wrapped}

    def export_model(self, model: nn.Module) -> nn.Module:
        """Undone in an export: recomputation only saves training memory, and its
        checkpoint calls would end up in a traced or exported graph."""
        return remove_activation_checkpointing(model)
