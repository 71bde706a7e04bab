"""FSDP2: shard parameters, gradients and optimizer state across the data-parallel
processes with ``torch.distributed.fsdp.fully_shard``.

Each process keeps 1/N of every sharded parameter (and so of its gradient and of the
optimizer's state for it). Before a block computes, its parameters are all-gathered;
after backward its gradients are reduce-scattered, so each rank steps only its shard.
``reshard_after_forward=True`` frees the gathered parameters after each block's forward
and gathers them again in backward (ZeRO-3); ``False`` keeps them until backward
(ZeRO-2: less communication, more memory).

The plugin shards at ``init`` (after the plugins that change the model: activation
checkpointing, channels-last, locality FFN; before torch.compile), points the
optimizer at the sharded parameters, and takes the place of the engine's DDP wrap
through the ``wrap_model`` step. Checkpoints go through the ``state_dicts`` /
``load_state_dicts`` steps: a full state dict on rank 0 by default (the same
``latest.pt`` as any run), or torch.distributed.checkpoint shards with
``sharded_checkpoint``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from slipstream import (
    DTYPES,
    Algorithm,
    ConfigError,
    State,
    check_plugin_options,
    hookimpl,
    meta_copy,
    plugin_option,
    requested_impl,
)

# Where "auto" finds the blocks: timm ViTs/ConvNeXts, timm and torchvision ResNets.
_BLOCK_CONTAINERS = ("blocks", "stages")
_RESNET_STAGES = ("layer1", "layer2", "layer3", "layer4")


@dataclass
class FSDPConfig:
    # Which modules become their own FSDP unit (each one gathers its parameters on its
    # own): "auto" (timm ViT blocks, ResNet stages), or a list of module class names or
    # dotted paths. min_params, when set, replaces it with a size policy.
    modules: Any = "auto"
    # shard every module holding this many parameters
    min_params: Optional[int] = plugin_option(None, low=1, whole=True, note="or null")
    reshard_after_forward: bool = True  # True: ZeRO-3; False: ZeRO-2
    # parameters as gathered for compute
    param_dtype: Optional[str] = plugin_option(None, choices=DTYPES, note="or null")
    reduce_dtype: Optional[str] = plugin_option(None, choices=DTYPES, note="or null")  # gradients as reduced
    cpu_offload: bool = False  # keep shards and optimizer state in host memory (CUDA)
    sharded_checkpoint: bool = False  # torch.distributed.checkpoint shards, not a full latest.pt

    def __post_init__(self) -> None:
        check_plugin_options(self)
        modules = self.modules
        if modules != "auto" and not (
            isinstance(modules, (list, tuple))
            and modules
            and all(isinstance(m, str) and m for m in modules)
        ):
            raise ValueError(
                "modules must be 'auto' or a non-empty list of module class names or dotted "
                f"paths (e.g. ['Block'] or ['blocks']), got {modules!r}"
            )


# -- choosing the units ----------------------------------------------------------------------


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def auto_units(model: nn.Module) -> list[str]:
    """The blocks of a timm ViT (``blocks.*``), a timm ConvNeXt-like model
    (``stages.*``) or a ResNet (``layer1`` ... ``layer4``); raises ValueError otherwise."""
    named = dict(model.named_modules())
    for container in _BLOCK_CONTAINERS:
        if isinstance(named.get(container), (nn.Sequential, nn.ModuleList)):
            return [f"{container}.{n}" for n, c in named[container].named_children() if _count(c)]
    stages = [name for name in _RESNET_STAGES if name in named and _count(named[name])]
    if stages:
        return stages
    raise ValueError(
        f"found no blocks to shard in {type(model).__name__} (no 'blocks', 'stages' or "
        "'layer1'..'layer4'); set modules to class names or paths, or min_params; its "
        f"children are: {', '.join(n for n, _ in model.named_children()) or 'none'}"
    )


def named_units(model: nn.Module, specs: Sequence[str]) -> list[str]:
    """Submodules named by dotted path or class name (outermost ones only)."""
    named = dict(model.named_modules())
    chosen: list[str] = []
    for spec in specs:
        if spec in named and spec:
            chosen.append(spec)
            continue
        of_class = [n for n, m in named.items() if n and type(m).__name__ == spec]
        if not of_class:
            classes = sorted({type(m).__name__ for n, m in named.items() if n and _count(m)})
            raise ValueError(
                f"{spec!r} is neither a submodule path nor a module class of "
                f"{type(model).__name__}; classes with parameters: {', '.join(classes)}"
            )
        chosen += of_class
    return [n for n in dict.fromkeys(chosen) if not any(n.startswith(o + ".") for o in chosen)]


def size_units(model: nn.Module, min_params: int) -> list[str]:
    """FSDP1's size policy: in post-order, a module becomes a unit when the parameters
    not already inside a unit below it reach ``min_params`` (the root is always one)."""
    units: list[str] = []

    def visit(name: str, module: nn.Module) -> int:
        own = sum(p.numel() for p in module.parameters(recurse=False))
        below = sum(visit(f"{name}.{n}" if name else n, c) for n, c in module.named_children())
        total = own + below
        if name and total >= min_params:
            units.append(name)
            return 0
        return total

    visit("", model)
    return units


def shard_model(
    model: nn.Module,
    units: Iterable[str],
    *,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload: bool = False,
) -> nn.Module:
    """``fully_shard`` each unit (children before parents), then the root. In place:
    parameters become DTensor shards, so an optimizer must be (re)pointed at them."""
    options: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    if offload:
        options["offload_policy"] = CPUOffloadPolicy()
    named = dict(model.named_modules())
    for name in sorted(units, key=lambda n: -n.count(".")):  # innermost first
        fully_shard(named[name], **options)
    # The root's own parameters (stem, head) form the last unit; it is never resharded
    # after forward, since backward starts with it anyway.
    return fully_shard(model, **{**options, "reshard_after_forward": False})


@torch.no_grad()
def make_contiguous(model: nn.Module) -> int:
    """Give every non-contiguous parameter (channels-last convolution weights)
    contiguous storage, in place (the Parameter objects stay, so an optimizer built on
    them is still right): FSDP2 shards only contiguous parameters. Returns how many."""
    changed = 0
    for p in model.parameters():
        if not p.is_contiguous():
            p.data = p.data.contiguous()
            changed += 1
    return changed


def unfuse_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Make ``optimizer`` step with its foreach implementation instead of the fused one,
    in place (torch reads the flags from the param groups at every step). FSDP2's DTensor
    parameters have sharding rules for the foreach kernels but none for the fused ones
    (``aten._fused_sgd_``, ``aten._fused_adamw_``: torch 2.14). Returns whether it was fused.

    Raises :class:`slipstream.ConfigError` when the user asked for the fused
    implementation by name (``optimizer.impl=fused``, or ``fused=True`` by hand): only
    ``auto``'s choice is changed, never an explicit one."""
    if not any(group.get("fused") for group in optimizer.param_groups):
        return False
    impl = requested_impl(optimizer)
    if impl != "auto":
        raise ConfigError(
            f"algorithms.fsdp cannot run optimizer.impl={impl} ({type(optimizer).__name__}): "
            "FSDP2's sharded (DTensor) parameters have no fused optimizer kernels in torch "
            f"{torch.__version__.split('+')[0]}; use optimizer.impl=auto (foreach under fsdp) or foreach"
        )
    for group in optimizer.param_groups:
        if group.get("fused"):
            group["fused"] = False
            if "foreach" in group:
                group["foreach"] = True
    optimizer.defaults["fused"] = False
    if "foreach" in optimizer.defaults:
        optimizer.defaults["foreach"] = True
    return True


def repoint_optimizer(optimizer: torch.optim.Optimizer, before: dict[int, str], model: nn.Module) -> None:
    """Point ``optimizer``'s groups at ``model``'s parameters of the same names.
    ``before`` maps ``id(parameter)`` to its name, taken before sharding replaced the
    parameters. In place, so schedulers that hold the optimizer stay valid."""
    now = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [now[before[id(p)]] for p in group["params"]]


# -- full optimizer state in torch's own layout -----------------------------------------------


def _optimizer_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def to_index_layout(osd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A full optimizer state dict keyed by parameter name (torch.distributed's) in
    ``optimizer.state_dict()``'s layout (keyed by position), so a run without FSDP, in
    one process, loads it with ``optimizer.load_state_dict``."""
    index = {name: i for i, name in enumerate(names)}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]]
    return {"state": {index[n]: s for n, s in osd["state"].items()}, "param_groups": groups}


def to_name_layout(osd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of :func:`to_index_layout`."""
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]
    return {"state": {names[int(i)]: s for i, s in osd["state"].items()}, "param_groups": groups}


def reshard(model: nn.Module) -> None:
    """Free every gathered parameter and put the shards back in the modules. A forward
    without a backward (evaluation) leaves the units that do not reshard after forward
    (the root; every unit under ZeRO-2) gathered, and their ``parameters()`` would then
    not be the shards the optimizer steps."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _holds_dtensors(state_dict: dict[str, Any]) -> bool:
    return any(isinstance(v, DTensor) for v in state_dict.values())


# -- the plugin ---------------------------------------------------------------------------------


class FSDP(Algorithm):
    """Shard parameters, gradients and optimizer state across processes (FSDP2, ZeRO-3/2)."""

    name = "fsdp"
    config_class = FSDPConfig
    # Model surgery first, so the final modules are sharded; torch.compile compiles the
    # sharded model; ema averages the shards.
    runs_after = ("locality_ffn", "channels_last", "activation_checkpointing", "mixed_precision")
    runs_before = ("torch_compile", "ema")

    def __init__(self, config: FSDPConfig | None = None) -> None:
        super().__init__(config)
        self.units: list[str] = []

    @hookimpl
    def init(self, state: State) -> None:
        # A process group of one, set up by the caller, is allowed: FSDP2 runs there
        # (nothing to shard), which is how one GPU tests it over NCCL.
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "algorithms.fsdp shards the model across processes and this run has one: "
                "launch it with `slipstream train --nproc-per-node N` (or torchrun), or drop fsdp"
            )
        cfg, model = self.config, state.unwrapped_model
        # Before any sharding, so a refusal leaves the model as it was.
        unfused = unfuse_optimizer(state.optimizer)
        try:
            if cfg.min_params is not None:
                self.units = size_units(model, cfg.min_params)
            elif cfg.modules == "auto":
                self.units = auto_units(model)
            else:
                self.units = named_units(model, cfg.modules)
        except ValueError as exc:
            raise ConfigError(f"algorithms.fsdp.modules: {exc}") from None
        mp = None
        if cfg.param_dtype or cfg.reduce_dtype:
            mp = MixedPrecisionPolicy(
                param_dtype=DTYPES.get(cfg.param_dtype), reduce_dtype=DTYPES.get(cfg.reduce_dtype)
            )
            if cfg.param_dtype and state.compute_dtype is None:
                state.compute_dtype = DTYPES[cfg.param_dtype]  # for MFU
        offload = cfg.cpu_offload and state.device.type == "cuda"
        if make_contiguous(model):
            # Inputs stay channels-last, and a convolution's output follows its input's
            # format, so the convolutions still run channels-last.
            warnings.warn(
                "fsdp: FSDP2 shards only contiguous parameters; the channels-last weights were "
                "made contiguous (inputs stay channels-last)",
                stacklevel=2,
            )
        # FSDP2 refuses deepcopy, which the FLOP count (MFU) makes of the model on the
        # meta device: hand it that copy now, while the model is still a plain module.
        state.flops_model = meta_copy(model)
        names = {id(p): n for n, p in model.named_parameters()}
        shard_model(
            model,
            self.units,
            reshard_after_forward=cfg.reshard_after_forward,
            mp_policy=mp,
            offload=offload,
        )
        repoint_optimizer(state.optimizer, names, model)
        state.summary["fsdp"] = {
            "units": len(self.units) + 1,
            "reshard_after_forward": cfg.reshard_after_forward,
            "cpu_offload": offload,
            "sharded_checkpoint": cfg.sharded_checkpoint,
            "optimizer_impl": "foreach (auto chose fused, which DTensor lacks)" if unfused else None,
        }

    @hookimpl
    def wrap_model(self, state: State) -> nn.Module:
        return state.model  # sharded at init: no DDP around it

    @hookimpl(tryfirst=True)
    def eval_end(self, state: State) -> None:
        reshard(state.unwrapped_model)  # before anyone reads the parameters

    @hookimpl
    def state_dicts(self, state: State) -> dict[str, Any]:
        model, optimizer = state.unwrapped_model, state.optimizer
        reshard(model)
        if self.config.sharded_checkpoint:  # DTensor shards: the engine writes them with DCP
            return {
                "model": get_model_state_dict(model),
                "optimizer": get_optimizer_state_dict(model, optimizer),
            }
        # Gathered to rank 0 (the writer) in host memory; the other ranks get {}.
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        osd = get_optimizer_state_dict(model, optimizer, options=full)
        return {
            "model": get_model_state_dict(model, options=full),
            "optimizer": to_index_layout(osd, _optimizer_names(model, optimizer)) if osd else osd,
        }

    @hookimpl
    def load_state_dicts(self, state: State, state_dicts: dict[str, Any]) -> bool:
        model, optimizer = state.unwrapped_model, state.optimizer
        msd, osd = state_dicts["model"], state_dicts["optimizer"]
        if _holds_dtensors(msd):
            set_model_state_dict(model, msd)
            set_optimizer_state_dict(model, optimizer, osd)
            return True
        # A full checkpoint, read by every rank: each keeps its own shards of it.
        full = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, msd, options=full)
        osd = to_name_layout(osd, _optimizer_names(model, optimizer))
        set_optimizer_state_dict(model, optimizer, osd, options=full)
        return True


__all__ = [
    "FSDP",
    "FSDPConfig",
    "auto_units",
    "make_contiguous",
    "named_units",
    "repoint_optimizer",
    "reshard",
    "shard_model",
    "size_units",
    "to_index_layout",
    "to_name_layout",
    "unfuse_optimizer",
]
