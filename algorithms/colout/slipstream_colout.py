"""ColOut (Composer's ColOut): drop a random fraction of the rows and of the columns of
each training batch's images, on the device, at ``batch_start``.

The images shrink (by default to about 0.85 x 0.85 = 72 % of their pixels), so each
step costs less, and the missing rows and columns act as a mild augmentation: a
random, non-uniform subsampling that keeps the whole field of view (unlike a crop).
Composer reports it as a speed-up of the same kind as progressive resizing, with
little loss in accuracy on ResNets.

``batch: true`` (Composer's batch mode) drops the same rows and columns for the whole
batch (one ``index_select`` per axis); ``batch: false`` draws them per image (two
gathers). Either way every image of a batch keeps the same number of rows and
columns, ``int(H * (1 - p_row))`` and ``int(W * (1 - p_col))`` as Composer keeps.

Randomness: each batch's rows and columns come from a generator on the batch's device
seeded with ``slipstream.batch_seed(seed, rank, batch, "colout")``: the same seed
gives the same batches, a resumed run continues exactly, and the global RNG is never
touched. Evaluation batches are left alone (the model is evaluated on whole images).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

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

__all__ = ["ColOut", "ColOutConfig", "colout_batch", "kept_size"]


def kept_size(size: int, p: float, multiple: int = 1) -> int:
    """How many of ``size`` rows (columns) ColOut keeps when it drops a fraction ``p``:
    ``int(size * (1 - p))`` as Composer, at least 1; with ``multiple`` > 1 (a ViT's
    patch size) the nearest multiple of it, at least one, at most ``size``.

    >>> kept_size(32, 0.15), kept_size(224, 0.15, 16), kept_size(3, 0.9)
    (27, 192, 1)
    """
    kept = max(1, int(size * (1.0 - p)))
    if multiple > 1:
        kept = min(size, multiple * max(1, round(kept / multiple)))
    return kept


def _kept_indices(
    count: int, size: int, rows: int, generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """``rows`` sorted indices out of ``size``, drawn without replacement, ``count`` times."""
    order = torch.rand(count, size, generator=generator, device=device).argsort(dim=1)
    return order[:, :rows].sort(dim=1).values


def colout_batch(
    images: torch.Tensor,
    p_row: float = 0.15,
    p_col: float = 0.15,
    generator: torch.Generator | None = None,
    *,
    batch: bool = True,
    multiple: int = 1,
) -> torch.Tensor:
    """Drop a fraction ``p_row`` of the rows and ``p_col`` of the columns of ``images``
    (``(N, C, H, W)``, any dtype, on any device) and return the smaller batch
    ``(N, C, kept_size(H, p_row), kept_size(W, p_col))``; the kept rows and columns stay
    in their order. ``batch``: the same rows and columns for every image (else drawn per
    image). Random numbers come from ``generator`` (on the images' device; the global
    RNG when None). ``multiple``: keep a multiple of it (a ViT's patch size).
    ``images`` itself is returned when nothing would be dropped.
    """
    check_value("p_row", p_row, low=0, high=1, high_open=True)
    check_value("p_col", p_col, low=0, high=1, high_open=True)
    if not isinstance(images, torch.Tensor) or images.dim() != 4:
        what = f"a {images.dim()}-D tensor" if isinstance(images, torch.Tensor) else type(images).__name__
        raise TypeError(f"colout: needs a batch of images (N, C, H, W), got {what}")
    n, c, h, w = images.shape
    rows, cols = kept_size(h, p_row, multiple), kept_size(w, p_col, multiple)
    if (rows, cols) == (h, w):
        return images
    draws = 1 if batch else n
    keep_rows = _kept_indices(draws, h, rows, generator, images.device)
    keep_cols = _kept_indices(draws, w, cols, generator, images.device)
    if batch:
        return images.index_select(2, keep_rows[0]).index_select(3, keep_cols[0])
    out = images.gather(2, keep_rows[:, None, :, None].expand(n, c, rows, w))
    return out.gather(3, keep_cols[:, None, None, :].expand(n, c, rows, cols))


@dataclass
class ColOutConfig:
    p_row: float = plugin_option(0.15, low=0, high=1, high_open=True, note="the fraction of rows dropped")
    p_col: float = plugin_option(0.15, low=0, high=1, high_open=True, note="the fraction of columns dropped")
    batch: bool = True  # the same rows and columns for the whole batch (Composer's batch mode)

    def __post_init__(self) -> None:
        check_plugin_options(self)
        if not isinstance(self.batch, bool):
            raise ValueError(f"batch must be true or false, got {self.batch!r}")


def _patch_multiple(model: nn.Module) -> int:
    """1 for a CNN; a ViT's patch size, after checking that it takes other sizes."""
    embed = getattr(model, "patch_embed", None)
    patch = getattr(embed, "patch_size", None)
    if patch is None:
        return 1
    patch = (patch, patch) if isinstance(patch, int) else tuple(int(p) for p in patch)
    if patch[0] != patch[1]:
        raise ConfigError(f"colout cannot change {type(model).__name__}: its patches are not square ({patch})")
    if getattr(embed, "strict_img_size", False):
        raise ConfigError(
            f"colout cannot change {type(model).__name__}: it only takes its own input size "
            "(patch_embed.strict_img_size); build it with dynamic_img_size=True or add image_size_curriculum"
        )
    return patch[0]


class ColOut(Algorithm):
    """Drop random rows and columns of every training batch's images (smaller, faster steps)."""

    name = "colout"
    config_class = ColOutConfig
    # After a resize (drop rows of the final size), before augmentation and mixing
    # (which then work on fewer pixels). The memory format is the engine's, set after
    # every batch transform.
    runs_after = ("image_size_curriculum",)
    runs_before = ("gpu_augmentation", "mixup", "cutmix")

    def __init__(self, config: ColOutConfig | None = None) -> None:
        super().__init__(config)
        self.multiple = 1
        self.size: tuple[int, int] | None = None  # the size of the last training batch

    @hookimpl
    def init(self, state: State) -> None:
        self.multiple = _patch_multiple(state.unwrapped_model)

    @hookimpl
    def batch_start(self, state: State) -> None:
        # Training batches only: evaluation fires eval_batch_start, which this plugin leaves alone.
        inputs, *rest = state.batch
        cfg = self.config
        seed = batch_seed(state.seed, state.rank, state.timestamp.batch, "colout")
        generator = torch.Generator(device=inputs.device).manual_seed(seed)
        out = colout_batch(inputs, cfg.p_row, cfg.p_col, generator, batch=cfg.batch, multiple=self.multiple)
        self.size = tuple(out.shape[-2:])
        state.batch = (out, *rest)
