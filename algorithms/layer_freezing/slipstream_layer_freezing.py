"""Layer freezing (Composer's LayerFreezing; FreezeOut, Brock et al. 2017): freeze the
earliest layers of the network progressively over the second part of the run.

Until ``freeze_start`` (a fraction of the run) nothing is frozen; from there the
fraction of layers frozen rises linearly to ``freeze_level`` at the end of the run
(Composer's schedule). A frozen layer's parameters get ``requires_grad=False`` and their
gradient is dropped (``grad=None``), so autograd computes no weight gradient for them,
no input gradient below the lowest layer still training, and the optimizer skips them
(torch's and timm's optimizers step only parameters that have a gradient: no momentum,
no weight decay). The parameters stay in the optimizer, so its state dict keeps its
layout and checkpoints load with or without the plugin.

What a "layer" is: every module that holds parameters of its own
(``parameters(recurse=False)``), in the model's module order (pre-order, the order
``model.modules()`` gives, which for timm and torchvision ResNets and ViTs is the order
of the forward pass). That is Composer's leaf modules with parameters (convolutions,
norms, linears), plus a module's own parameters where it has children too (a timm ViT's
``cls_token`` and ``pos_embed`` form its first layer, which Composer never freezes).
The last layer (the classifier head) is never frozen, as in Composer: ``freeze_level``
1.0 freezes all the layers before it.

The frozen set changes after an optimizer step (``interval: batch``, every step, so a
group of accumulated batches trains one set) or at the end of each epoch
(``interval: epoch``, Composer's ``Event.EPOCH_END``). How many layers are frozen is in
the checkpoint, so a resumed run continues with the same set, bit-exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from slipstream import Algorithm, ConfigError, State, check_plugin_options, check_value, hookimpl, plugin_option

__all__ = ["LayerFreezing", "LayerFreezingConfig", "freeze_layers", "freeze_schedule", "frozen_depth", "layers"]

INTERVALS = ("batch", "epoch")


@dataclass
class LayerFreezingConfig:
    # the fraction of the run trained before any layer is frozen
    freeze_start: float = plugin_option(0.5, low=0, high=1, high_open=True, note="a fraction of the run")
    # the fraction of the layers (the head aside) frozen at the end of the run
    freeze_level: float = plugin_option(1.0, low=0, high=1, note="a fraction of the layers; 0 = nothing frozen")
    # when the frozen set may grow: after each optimizer step, or at each epoch's end (Composer's)
    interval: str = plugin_option("batch", choices=INTERVALS)

    def __post_init__(self) -> None:
        check_plugin_options(self)


def freeze_schedule(fraction: float, freeze_start: float = 0.5, freeze_level: float = 1.0) -> float:
    """The fraction of the layers frozen when ``fraction`` of the run has passed:
    0 until ``freeze_start``, then rising linearly to ``freeze_level`` at 1.0
    (Composer's ``_freeze_schedule``).

    >>> [round(freeze_schedule(t), 2) for t in (0.25, 0.5, 0.75, 1.0)]
    [0.0, 0.0, 0.5, 1.0]
    """
    check_value("freeze_start", freeze_start, low=0, high=1, high_open=True)
    check_value("freeze_level", freeze_level, low=0, high=1)
    if fraction <= freeze_start:
        return 0.0
    return freeze_level * min(1.0, (fraction - freeze_start) / (1.0 - freeze_start))


def layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's layers in order, each ``(name, module)``: every module that holds
    parameters of its own, in module (pre-)order. The last is the head, which
    :func:`freeze_layers` never freezes."""
    return [(name, m) for name, m in model.named_modules() if next(m.parameters(recurse=False), None) is not None]


def frozen_depth(num_layers: int, fraction: float, freeze_start: float = 0.5, freeze_level: float = 1.0) -> int:
    """How many of ``num_layers`` layers (the first ones) are frozen at ``fraction`` of
    the run: ``int(freeze_schedule(...) * (num_layers - 1))``, the head left out.

    >>> frozen_depth(11, 0.75), frozen_depth(11, 1.0), frozen_depth(11, 1.0, freeze_level=0.5)
    (5, 10, 5)
    """
    return int(freeze_schedule(fraction, freeze_start, freeze_level) * max(num_layers - 1, 0))


def _freeze(modules: list[nn.Module]) -> int:
    """Freeze the parameters these modules hold themselves; the number of values frozen."""
    count = 0
    for module in modules:
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                count += p.numel()
            p.requires_grad_(False)
            p.grad = None  # a partial gradient (mid-accumulation) must not step it
    return count


def freeze_layers(
    model: nn.Module, current_duration: float, freeze_start: float = 0.5, freeze_level: float = 1.0
) -> tuple[int, float]:
    """Freeze the earliest layers of ``model`` for a run ``current_duration`` (0 to 1)
    through (Composer's ``freeze_layers``, without its optimizer argument: a frozen
    parameter has no gradient, which torch's optimizers skip). Returns the number of
    layers frozen and the fraction of the layers that is. Layers frozen before stay
    frozen; nothing is unfrozen.

    >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.Linear(2, 2))
    >>> freeze_layers(model, 1.0, freeze_start=0.0, freeze_level=0.5)
    (1, 0.5)
    >>> [p.requires_grad for p in model.parameters()]
    [False, False, True, True, True, True]
    """
    found = [m for _, m in layers(model)]
    fraction = freeze_schedule(current_duration, freeze_start, freeze_level)
    depth = frozen_depth(len(found), current_duration, freeze_start, freeze_level)
    _freeze(found[:depth])
    return depth, fraction


def _ddp_options(state: State) -> dict[str, Any]:
    trainer = state.config.get("trainer") if isinstance(state.config, dict) else None
    return dict((trainer or {}).get("ddp") or {})


class LayerFreezing(Algorithm):
    """Freeze the earliest layers progressively from freeze_start to the run's end (no gradient, no step)."""

    name = "layer_freezing"
    config_class = LayerFreezingConfig
    # Count the layers of the final model: after surgery that adds or replaces layers.
    runs_after = ("locality_ffn", "blurpool", "stochastic_depth", "activation_checkpointing", "channels_last")
    conflicts_with = {
        "torch_compile": (
            "each change of the frozen set recompiles the model (AOTAutograd specialises on which parameters "
            "require gradients), once per layer frozen, and past torch's recompile limit the model runs "
            "uncompiled; use one of the two"
        ),
        "fsdp": (
            "freezing FSDP2's sharded (DTensor) parameters mid-run is not verified; use DDP (the default) "
            "with trainer.ddp.find_unused_parameters=true"
        ),
    }

    def __init__(self, config: LayerFreezingConfig | None = None) -> None:
        super().__init__(config)
        self.layers: list[tuple[str, nn.Module]] = []
        self.depth = 0  # layers frozen so far (the first ones)
        self.frozen_values = 0
        self._stepped = False

    @hookimpl
    def init(self, state: State) -> None:
        if state.world_size > 1:
            ddp = _ddp_options(state)
            if not ddp.get("find_unused_parameters") or ddp.get("static_graph"):
                raise ConfigError(
                    "algorithms.layer_freezing: under DDP set trainer.ddp.find_unused_parameters=true (and "
                    "static_graph=false): parameters frozen during the run get no gradient, which DDP must be "
                    "told to expect"
                )
        self.layers = layers(state.unwrapped_model)
        if len(self.layers) < 2:
            raise ConfigError(
                f"algorithms.layer_freezing: {type(state.unwrapped_model).__name__} has "
                f"{len(self.layers)} layer(s) with parameters; with the head never frozen, nothing could be"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"frozen_layers": self.depth, "layers": len(self.layers)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if int(state_dict["layers"]) != len(self.layers):
            raise ConfigError(
                f"algorithms.layer_freezing: the checkpoint counted {state_dict['layers']} layers, this model "
                f"has {len(self.layers)}: it was written for another model"
            )
        # Here, before the model is wrapped: DDP leaves parameters frozen now out of its buckets.
        self._advance(int(state_dict["frozen_layers"]))

    def _advance(self, depth: int) -> None:
        if depth > self.depth:
            self.frozen_values += _freeze([m for _, m in self.layers[self.depth : depth]])
            self.depth = depth

    def _update(self, state: State) -> None:
        cfg = self.config
        self._advance(frozen_depth(len(self.layers), state.fraction_done(), cfg.freeze_start, cfg.freeze_level))
        state.metrics["frozen_layers"] = self.depth

    @hookimpl
    def after_optimizer_step(self, state: State) -> None:
        self._stepped = True

    @hookimpl
    def batch_end(self, state: State) -> None:
        # After a step only: under gradient accumulation a group trains one frozen set.
        if self.config.interval == "batch" and self._stepped:
            self._update(state)
        self._stepped = False

    @hookimpl
    def epoch_end(self, state: State) -> None:
        if self.config.interval == "epoch":
            self._update(state)

    @hookimpl
    def fit_end(self, state: State) -> None:
        total = sum(p.numel() for _, m in self.layers for p in m.parameters(recurse=False))
        state.summary["layer_freezing"] = {
            "layers": len(self.layers),
            "frozen_layers": self.depth,
            "frozen_parameter_fraction": round(self.frozen_values / total, 4) if total else 0.0,
        }
