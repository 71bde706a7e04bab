"""Pixel values for plugins that transform image batches.

Built-in datasets keep images ``uint8`` (0-255) through collate and transfer, a
quarter of the bytes of float32; the engine converts them to float once, on the
device, after every batch transform. A plugin that must compute on pixels (resize,
augment) calls :func:`to_unit_float` first; a plugin that only moves pixels (crop,
flip) may keep them ``uint8``.
"""

from __future__ import annotations

import torch


def to_unit_float(inputs: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``inputs`` as floating point in [0, 1]: ``uint8`` is divided by 255, a
    floating-point tensor (assumed in [0, 1] already) is returned as it is.

    A new tensor for ``uint8`` inputs, so the caller may modify it in place; the
    memory format is kept.

    >>> to_unit_float(torch.tensor([0, 51, 255], dtype=torch.uint8))
    tensor([0.0000, 0.2000, 1.0000])
    """
    if inputs.is_floating_point():
        return inputs
    if inputs.dtype != torch.uint8:
        raise TypeError(
            f"image batches must be uint8 (0-255) or floating point (0-1); got {inputs.dtype}"
        )
    return inputs.to(dtype).div_(255)
