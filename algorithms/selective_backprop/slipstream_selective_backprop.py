"""Selective backprop (Jiang et al. 2019, "Accelerating Deep Learning by Focusing on
the Biggest Losers"; Composer's SelectiveBackprop): train each batch inside a window of
the run on the part of it with the highest loss.

On a selective batch the plugin first scores every sample with a forward pass without
gradients (at ``scale_factor`` of the image size, to make it cheaper), then keeps
``keep`` of the batch, chosen by loss, and the run's own forward, loss and backward see
only those. Easy samples, which the model already gets right, cost no backward: the
step is cheaper, and its gradient is that of the samples that still teach something.

When: batches while the run is between ``start`` and ``end`` (fractions of the run,
Composer's 0.5 and 0.9: the model first learns from everything, and ends on whole
batches too), except every ``interrupt``-th batch of an epoch, which trains plainly
(Composer's ``(batch_in_epoch + 1) % interrupt != 0``).

Which samples: ``selection: sample`` (Composer's, the paper's): the samples sorted by
loss, ``int(keep * N)`` of them drawn without replacement with probability rising with
their loss percentile ``p`` as ``p ** (1 / keep - 1)``; ``selection: top``: the
``int(keep * N)`` highest losses. At least two are kept (a batch-norm layer needs two
samples in training). The draw comes from a generator on the batch's device seeded with
``slipstream.batch_seed(seed, rank, batch, "selective_backprop")``: no host sync, no
generator state, and a resumed run selects what the uninterrupted one did.

Where: ``before_forward``, where the batch is final (augmented, mixed, normalised, in its
memory format), so the scores are those of what the model trains on, soft targets of
``mixup``/``cutmix`` included. The scoring pass runs the model in training mode (as
Composer's), under the autocast of the run's compute dtype (``state.compute_dtype``,
set by ``mixed_precision``), with the run's ``state.loss_fn`` made per-sample, and it
leaves the model's buffers (batch-norm running statistics) as they were: they count each
batch once, as the model trains on it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slipstream import (
    Algorithm,
    ConfigError,
    State,
    batch_seed,
    check_plugin_options,
    check_value,
    hookimpl,
    plugin_option,
)

__all__ = [
    "SelectiveBackprop",
    "SelectiveBackpropConfig",
    "kept_count",
    "per_sample_loss",
    "select_indices",
    "select_using_loss",
    "should_selective_backprop",
]

SELECTIONS = ("sample", "top")
_INTERPOLATION = {3: "linear", 4: "bilinear", 5: "trilinear"}


@dataclass
class SelectiveBackpropConfig:
    # the window of the run (fractions of it) whose batches are selective
    start: float = plugin_option(0.5, low=0, high=1, note="a fraction of the run")
    end: float = plugin_option(0.9, low=0, high=1, note="a fraction of the run, above start")
    # the fraction of each selective batch that is trained on
    keep: float = plugin_option(0.5, low=0, high=1, low_open=True, note="1 = every sample (off)")
    # the scoring pass sees images scaled by this (cheaper); the trained samples stay whole
    scale_factor: float = plugin_option(1.0, low=0, high=1, low_open=True)
    # every interrupt-th batch of an epoch trains on the whole batch; 0: none does
    interrupt: int = plugin_option(2, low=0, whole=True, note="0 = never interrupted")
    # sample: Composer's loss-weighted draw; top: the highest losses
    selection: str = plugin_option("sample", choices=SELECTIONS)

    def __post_init__(self) -> None:
        check_plugin_options(self)
        if self.end <= self.start:
            raise ValueError(f"end must be above start ({self.start}), got {self.end}")


def should_selective_backprop(
    current_duration: float, batch_idx: int, start: float = 0.5, end: float = 0.9, interrupt: int = 2
) -> bool:
    """Whether the batch ``batch_idx`` (0-based, in its epoch), when ``current_duration``
    of the run has passed, is selective: inside ``[start, end)`` and not an
    ``interrupt``-th batch (Composer's rule).

    >>> [should_selective_backprop(0.6, b) for b in range(4)]
    [True, False, True, False]
    >>> should_selective_backprop(0.4, 0), should_selective_backprop(0.9, 0)
    (False, False)
    >>> should_selective_backprop(0.6, 1, interrupt=0)
    True
    """
    inside = start <= current_duration < end
    return inside and (interrupt == 0 or (batch_idx + 1) % interrupt != 0)


def kept_count(n: int, keep: float) -> int:
    """How many of ``n`` samples a selective batch keeps: ``int(keep * n)`` (Composer's),
    at least two (a batch-norm layer needs two in training), at most ``n``.

    >>> kept_count(32, 0.5), kept_count(5, 0.3), kept_count(1, 0.5)
    (16, 2, 1)
    """
    return min(n, max(2, int(keep * n)))


def select_indices(
    losses: Tensor, keep: float = 0.5, generator: torch.Generator | None = None, selection: str = "sample"
) -> Tensor:
    """The indices (ascending) of the samples kept from per-sample ``losses`` ``(N,)``:
    :func:`kept_count` of them, drawn with probability rising with the loss percentile
    (``sample``; ``generator`` on the losses' device, or the global RNG) or the highest
    (``top``). Ties are broken by position, so the result is deterministic.

    >>> select_indices(torch.tensor([0.1, 3.0, 0.2, 2.0]), 0.5, selection="top").tolist()
    [1, 3]
    """
    check_value("keep", keep, low=0, high=1, low_open=True)
    check_value("selection", selection, choices=SELECTIONS)
    n = losses.shape[0]
    k = kept_count(n, keep)
    order = torch.argsort(losses.detach().float(), stable=True)  # lowest loss first
    if selection == "top":
        chosen = order[n - k :]
    else:
        # The percentile of each rank, (i + 0.5) / n, to the power 1 / keep - 1 (Composer's).
        percentile = (torch.arange(n, device=losses.device, dtype=torch.float64) + 0.5) / n
        weights = percentile ** (1.0 / keep - 1.0)
        chosen = order[torch.multinomial(weights, k, replacement=False, generator=generator)]
    return chosen.sort().values


def per_sample_loss(loss_fn: Callable[..., Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
    """``loss_fn`` as a function returning one loss per sample ``(N,)``: torch's
    cross-entropy with ``reduction='none'`` (its weights, ignore_index and label smoothing
    kept), a loss module's copy with ``reduction='none'`` (its other dimensions averaged),
    or, for any other callable, ``loss_fn`` called on each sample alone."""
    if isinstance(loss_fn, nn.CrossEntropyLoss):
        fn = loss_fn

        def cross_entropy(outputs: Tensor, targets: Tensor) -> Tensor:
            return F.cross_entropy(outputs, targets, weight=fn.weight, ignore_index=fn.ignore_index,
                                   reduction="none", label_smoothing=fn.label_smoothing)  # fmt: skip

        return cross_entropy
    if loss_fn is F.cross_entropy or getattr(loss_fn, "func", None) is F.cross_entropy:  # a partial too
        return lambda outputs, targets: loss_fn(outputs, targets, reduction="none")
    if isinstance(loss_fn, nn.Module) and isinstance(getattr(loss_fn, "reduction", None), str):
        unreduced = copy.copy(loss_fn)
        unreduced.reduction = "none"

        def module_loss(outputs: Tensor, targets: Tensor) -> Tensor:
            out = unreduced(outputs, targets)
            return out.reshape(out.shape[0], -1).mean(dim=1) if out.ndim > 1 else out

        return module_loss

    def one_by_one(outputs: Tensor, targets: Tensor) -> Tensor:
        return torch.stack([loss_fn(outputs[i : i + 1], targets[i : i + 1]).reshape(()) for i in range(len(outputs))])

    return one_by_one


def _scaled(inputs: Tensor, scale_factor: float) -> Tensor:
    if scale_factor == 1.0:
        return inputs
    mode = _INTERPOLATION.get(inputs.ndim)
    if mode is None:
        raise ConfigError(
            f"algorithms.selective_backprop.scale_factor={scale_factor} needs inputs of 3, 4 or 5 dimensions "
            f"(N, C, ...), got {tuple(inputs.shape)}; use scale_factor=1"
        )
    return F.interpolate(inputs, scale_factor=scale_factor, mode=mode)


class _buffers_kept:
    """Within: the model's buffers may change (a training-mode forward); after: as before."""

    def __init__(self, model: nn.Module) -> None:
        self.buffers = [b for b in model.buffers() if b.is_floating_point() or b.dtype == torch.long]

    def __enter__(self) -> None:
        self.saved = [b.detach().clone() for b in self.buffers]

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for b, s in zip(self.buffers, self.saved, strict=True):
                b.copy_(s)


@torch.no_grad()
def select_using_loss(
    inputs: Tensor,
    targets: Tensor,
    model: Callable[[Tensor], Tensor],
    loss_fn: Callable[..., Tensor],
    keep: float = 0.5,
    scale_factor: float = 1.0,
    generator: torch.Generator | None = None,
    selection: str = "sample",
) -> tuple[Tensor, Tensor]:
    """Keep ``keep`` of the batch by loss (Composer's ``select_using_loss``): score every
    sample with ``model`` (no gradients) on ``inputs`` scaled by ``scale_factor`` and
    ``loss_fn`` made per-sample (:func:`per_sample_loss`), then return the kept inputs
    (whole, not scaled) and targets, in their order. Run it under the autocast you train
    in; the model's buffers are left as the scoring pass leaves them.

    >>> model = nn.Linear(3, 2); x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    >>> kept_x, kept_y = select_using_loss(x, y, model, F.cross_entropy, keep=0.5)
    >>> kept_x.shape, kept_y.shape
    (torch.Size([4, 3]), torch.Size([4]))
    """
    check_value("scale_factor", scale_factor, low=0, high=1, low_open=True)
    losses = per_sample_loss(loss_fn)(model(_scaled(inputs, scale_factor)).float(), targets)
    index = select_indices(losses, keep, generator, selection)
    return inputs[index], targets[index]


def _refuse_strict_size(model: nn.Module) -> None:
    embed = getattr(model, "patch_embed", None)
    # A ViT built for one size: its patch embedding refuses others, or its position
    # embedding does not fit them.
    fixed = getattr(embed, "strict_img_size", False) or getattr(model, "dynamic_img_size", None) is False
    if embed is not None and fixed:
        raise ConfigError(
            f"algorithms.selective_backprop.scale_factor < 1: {type(model).__name__} only takes its own input "
            "size (patch_embed.strict_img_size); build it with dynamic_img_size=True or use scale_factor=1"
        )


class SelectiveBackprop(Algorithm):
    """Train each batch of a window of the run on its highest-loss part (a no-grad scoring pass first)."""

    name = "selective_backprop"
    config_class = SelectiveBackpropConfig
    # After stochastic_depth has drawn this batch's masks (the scoring pass uses them, so
    # it depends on the batch alone); before torch_compile marks the kept batch dynamic.
    runs_after = ("stochastic_depth",)
    runs_before = ("torch_compile",)

    def __init__(self, config: SelectiveBackpropConfig | None = None) -> None:
        super().__init__(config)
        self.steps = 0  # selective batches so far
        self.scored = 0  # samples scored on them
        self.kept = 0  # samples trained on them
        self._loss: Callable[[Tensor, Tensor], Tensor] | None = None
        self._loss_source: Any = None

    @hookimpl
    def init(self, state: State) -> None:
        if self.config.scale_factor < 1:
            _refuse_strict_size(state.unwrapped_model)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "scored": self.scored, "kept": self.kept}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps, self.scored, self.kept = (int(state_dict[k]) for k in ("steps", "scored", "kept"))

    def applies(self, state: State) -> bool:
        cfg = self.config
        return cfg.keep < 1 and should_selective_backprop(
            state.fraction_done(), state.timestamp.batch_in_epoch, cfg.start, cfg.end, cfg.interrupt
        )

    def _per_sample(self, state: State) -> Callable[[Tensor, Tensor], Tensor]:
        if self._loss is None or state.loss_fn is not self._loss_source:
            self._loss, self._loss_source = per_sample_loss(state.loss_fn), state.loss_fn
        return self._loss

    @hookimpl
    def before_forward(self, state: State) -> None:
        if not self.applies(state):
            return
        cfg = self.config
        inputs, targets, *rest = state.batch
        n = inputs.shape[0]
        if kept_count(n, cfg.keep) >= n:
            return  # a batch too small to select from
        dtype = state.compute_dtype
        autocast = (
            torch.autocast(state.device.type, dtype=dtype)
            if dtype in (torch.bfloat16, torch.float16)
            else nullcontext()
        )
        with torch.no_grad(), _buffers_kept(state.unwrapped_model), autocast:
            outputs = state.model(_scaled(inputs, cfg.scale_factor))
        losses = self._per_sample(state)(outputs.float(), targets)
        generator = torch.Generator(device=losses.device)
        generator.manual_seed(batch_seed(state.seed, state.rank, state.timestamp.batch, self.name))
        index = select_indices(losses, cfg.keep, generator, cfg.selection)
        kept = inputs.index_select(0, index)
        if kept.ndim == 4:  # the engine set the memory format already; keep it
            kept = kept.contiguous(memory_format=state.input_memory_format)
        rest = [r.index_select(0, index) if isinstance(r, Tensor) and r.shape[:1] == (n,) else r for r in rest]
        state.batch = (kept, targets.index_select(0, index), *rest)
        self.steps += 1
        self.scored += n
        self.kept += index.shape[0]

    @hookimpl
    def fit_end(self, state: State) -> None:
        state.summary["selective_backprop"] = {"steps": self.steps, "scored": self.scored, "kept": self.kept}
