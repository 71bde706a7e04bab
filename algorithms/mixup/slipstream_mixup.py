"""MixUp: train on convex combinations of pairs of images and of their labels.

Each training batch is replaced, on the device at ``batch_start``, by
``lam * x + (1 - lam) * x.roll(1)``, its labels by the same mix of one-hot rows,
with ``lam ~ Beta(alpha, alpha)`` drawn once per batch (Zhang et al. 2018). The
soft targets are the representation: ``state.batch`` becomes ``(inputs, probs)``
with ``probs`` of shape ``(N, num_classes)``, rows summing to 1, and the loss is
torch's cross-entropy with probability targets. Multi-hot targets of a multi-label
run (``(N, num_classes)`` floats, ``loss.name=bce``) are mixed the same way, each
class weighted by the share of the images that show it. So the engine's default
``compute_loss`` needs no change, and ``label_smoothing`` (which swaps in
``nn.CrossEntropyLoss(label_smoothing=s)`` around that step) smooths the mixed
targets, in either order. Evaluation batches are never touched.

Reproducibility: every draw comes from a ``numpy.random.Generator`` seeded from
``(run seed, rank, batch index, "mixup")`` (timm's Mixup draws from numpy's
global state, which a resumed run cannot restore): the same seed mixes the same
batches, and a run resumed mid-epoch continues exactly, with nothing to checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from slipstream import (
    Algorithm,
    ConfigError,
    State,
    batch_seed,
    check_plugin_options,
    hookimpl,
    plugin_option,
    to_unit_float,
)


@dataclass
class MixupConfig:
    # Beta(alpha, alpha) for the mixing weight; small alpha = mostly one image
    alpha: float = plugin_option(0.2, low=0, low_open=True, note="the Beta distribution's parameter")
    prob: float = plugin_option(1.0, low=0, high=1, note="the fraction of batches mixed")
    # None: the run's (model.num_classes, or the model's head)
    num_classes: Optional[int] = plugin_option(None, low=2, whole=True, note="or null: the run's")

    def __post_init__(self) -> None:
        check_plugin_options(self)


def draw_lambda(alpha: float, generator: np.random.Generator | None = None) -> float:
    """The mixing weight, ``Beta(alpha, alpha)``: the share of each sample's own image."""
    generator = generator if generator is not None else np.random.default_rng()
    return float(generator.beta(alpha, alpha))


def mix_targets(targets: torch.Tensor, num_classes: int, lam: float) -> torch.Tensor:
    """``lam * p + (1 - lam) * p.roll(1)`` where ``p`` is the one-hot rows of class
    indices ``targets``, or ``targets`` itself when it is already ``(N, num_classes)``:
    class probabilities (rows summing to 1, and so do the mixed ones) or multi-hot
    vectors of a multi-label run (each class then weighs as much as the images that
    show it: 1 in both, ``lam`` or ``1 - lam`` in one, 0 in neither), as timm's Mixup
    mixes its one-hot and multi-hot targets."""
    if targets.ndim == 1:
        probs = F.one_hot(targets.long(), num_classes).float()
    elif targets.ndim == 2 and targets.shape[1] == num_classes:
        probs = targets.float()
    else:
        raise ConfigError(
            f"mixing needs targets of class indices (N,) or of {num_classes} classes (N, {num_classes}), "
            f"got shape {tuple(targets.shape)}"
        )
    return torch.lerp(probs.roll(1, 0), probs, lam)


def mixup_batch(
    inputs: torch.Tensor,
    targets: torch.Tensor,
    num_classes: int,
    alpha: float = 0.2,
    generator: np.random.Generator | None = None,
    lam: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Mix every sample with its neighbour (the batch rolled by one, as
    torchvision's MixUp pairs them; with a shuffled loader the pairs are random).

    ``inputs`` is ``uint8`` (0-255) or float in [0, 1], ``(N, C, H, W)``; ``lam`` is
    drawn from ``Beta(alpha, alpha)`` with ``generator`` unless given. Returns the
    mixed float batch in [0, 1], the soft targets ``(N, num_classes)`` and ``lam``.
    ``inputs`` and ``targets`` are not modified.
    """
    if lam is None:
        lam = draw_lambda(alpha, generator)
    x = to_unit_float(inputs)
    return torch.lerp(x.roll(1, 0), x, lam), mix_targets(targets, num_classes, lam), lam


# The per-batch draw that picks cutmix or mixup when both are enabled: a stream of its
# own, so neither plugin's draws (whether to mix, lam, the box) change with the switch.
SWITCH_STREAM = "mixup_cutmix_switch"


def switch_to_cutmix(seed: int, rank: int, batch: int, switch_prob: float) -> bool:
    """Whether batch ``batch`` of ``rank`` is CutMix's (else MixUp's) when both are
    enabled: a uniform draw seeded with ``batch_seed(seed, rank, batch,
    SWITCH_STREAM)`` is below ``switch_prob`` (0: always MixUp, 1: always CutMix).
    Both plugins compute it, so exactly one of them mixes each batch."""
    u = np.random.default_rng(batch_seed(seed, rank, batch, SWITCH_STREAM)).random()
    return bool(u < switch_prob)


def infer_num_classes(state: State) -> int | None:
    """The run's number of classes: ``model.num_classes`` of the config, the
    model's own ``num_classes`` (timm), or the width of its last linear layer."""
    from_config = (state.config.get("model") or {}).get("num_classes")
    if from_config:
        return int(from_config)
    model = state.unwrapped_model
    if isinstance(getattr(model, "num_classes", None), int) and model.num_classes > 0:
        return model.num_classes
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return linears[-1].out_features if linears else None


def check_soft_target_loss(name: str, state: State, num_classes: int) -> None:
    """Refuse, before the first batch, a loss that cannot take class probabilities."""
    logits = torch.zeros(2, num_classes, device=state.device)
    probs = torch.full((2, num_classes), 1 / num_classes, device=state.device)
    try:
        state.loss_fn(logits, probs)
    except Exception as exc:
        raise ConfigError(
            f"algorithms.{name}: the run's loss_fn ({type(state.loss_fn).__name__}) does not take "
            f"class-probability targets ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
            "use nn.CrossEntropyLoss (the default), which does"
        ) from None


def resolve_num_classes(name: str, state: State, configured: int | None) -> int:
    inferred = infer_num_classes(state)
    if configured and inferred and configured != inferred:
        raise ConfigError(
            f"algorithms.{name}.num_classes={configured} but the model has {inferred} classes "
            f"(its output); set it to {inferred} or leave it null for the model's"
        )
    num_classes = configured or inferred
    if num_classes is None:
        raise ConfigError(
            f"algorithms.{name}: cannot tell the number of classes from the model; "
            f"set algorithms.{name}.num_classes"
        )
    check_soft_target_loss(name, state, num_classes)
    return num_classes


class BatchMixing(Algorithm):
    """What MixUp and CutMix share: at ``batch_start``, with probability
    ``config.prob``, the training batch and its labels become :meth:`mix`'s, drawn
    from a generator seeded per batch; the class count is checked at ``init``."""

    # Mix the final training images: after resizing and per-sample augmentation.
    runs_after = ("image_size_curriculum", "gpu_augmentation")
    # The mixing plugin this one switches with per batch when both are enabled.
    switch_partner: str = ""

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.num_classes = 0
        self.cutmix: Optional[BatchMixing] = None  # set when cutmix and mixup share the run

    @hookimpl
    def init(self, state: State) -> None:
        # Checked here, before the run directory is written; fit_start takes the
        # value once every plugin's init has shaped the model.
        resolve_num_classes(self.name, state, self.config.num_classes)
        partner = next(
            (a for a in state.algorithms if a.name == self.switch_partner and isinstance(a, BatchMixing)),
            None,
        )
        self.cutmix = None if partner is None else (self if self.name == "cutmix" else partner)

    def mixes_this_batch(self, state: State) -> bool:
        """Alone: always (its own ``prob`` decides then). With its partner: when the
        per-batch switch draw picks this plugin (:func:`switch_to_cutmix`)."""
        if self.cutmix is None:
            return True
        to_cutmix = switch_to_cutmix(
            state.seed, state.rank, state.timestamp.batch, self.cutmix.config.switch_prob
        )
        return to_cutmix == (self is self.cutmix)

    @hookimpl
    def fit_start(self, state: State) -> None:
        self.num_classes = resolve_num_classes(self.name, state, self.config.num_classes)

    @hookimpl
    def batch_start(self, state: State) -> None:
        # Training batches only: evaluation fires eval_batch_start, left alone.
        if not self.mixes_this_batch(state):
            return  # cutmix and mixup together: this batch is the other's
        rng = np.random.default_rng(batch_seed(state.seed, state.rank, state.timestamp.batch, self.name))
        if rng.random() >= self.config.prob:
            return
        inputs, targets, *rest = state.batch
        mixed, soft = self.mix(inputs, targets, rng)
        state.batch = (mixed, soft, *rest)

    def mix(
        self, inputs: torch.Tensor, targets: torch.Tensor, rng: np.random.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The mixed batch and its soft targets ``(N, num_classes)``."""
        raise NotImplementedError


class Mixup(BatchMixing):
    """MixUp: train on convex combinations of image pairs and their one-hot labels."""

    name = "mixup"
    config_class = MixupConfig
    # With cutmix: one of the two mixes each batch (algorithms.cutmix.switch_prob).
    switch_partner = "cutmix"

    def mix(
        self, inputs: torch.Tensor, targets: torch.Tensor, rng: np.random.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mixed, soft, _ = mixup_batch(inputs, targets, self.num_classes, self.config.alpha, rng)
        return mixed, soft

