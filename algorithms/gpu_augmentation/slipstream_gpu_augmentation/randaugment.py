"""timm's RandAugment (``rand-m9-mstd0.5-inc1``) on a whole batch, on its device.

timm (``timm/data/auto_augment.py``) augments one PIL image at a time: for each of
``n`` layers it picks an operation for that image, applies it with probability ``p``
at a magnitude drawn around ``m`` (Gaussian noise ``mstd``, clipped to [0, 10]), and
maps the magnitude to the operation's argument (``_LEVEL_DENOM`` = 10). Here every
one of those draws is made for the whole batch on the host, with one CPU generator
(a few numbers per image: no device synchronisation, and the same choices on any
device); the images are grouped by the operation they drew, and each group is
transformed in one batched call on the batch's device. Geometric operations of a
layer share one ``grid_sample``.

Images are float in [0, 1] here, not PIL's 8-bit levels: the operations defined on
levels (posterize, solarize, equalize) read ``round(255 x)``, the others compute in
float. What differs from timm is listed in :data:`APPROXIMATED`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LEVEL_DENOM = 10.0  # timm's _LEVEL_DENOM: magnitude m of 10 is an operation's full strength

# timm's _RAND_TRANSFORMS and _RAND_INCREASING_TRANSFORMS (inc1), in timm's order.
RAND_TRANSFORMS = (
    "AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "SolarizeAdd",
    "Color", "Contrast", "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateXRel",
    "TranslateYRel",
)  # fmt: skip
RAND_INCREASING_TRANSFORMS = (
    "AutoContrast", "Equalize", "Invert", "Rotate", "PosterizeIncreasing", "SolarizeIncreasing",
    "SolarizeAdd", "ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing",
    "SharpnessIncreasing", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel",
)  # fmt: skip
# timm's -t<name> sets (weighted ones are drawn without replacement, as timm does).
TRANSFORM_SETS: dict[str, dict[str, float] | tuple[str, ...]] = {
    "weights": {
        "Rotate": 3, "ShearX": 2, "ShearY": 2, "TranslateXRel": 1, "TranslateYRel": 1,
        "ColorIncreasing": 0.25, "SharpnessIncreasing": 0.25, "AutoContrast": 0.25,
        "SolarizeIncreasing": 0.05, "SolarizeAdd": 0.05, "ContrastIncreasing": 0.05,
        "BrightnessIncreasing": 0.05, "Equalize": 0.05, "PosterizeIncreasing": 0.05, "Invert": 0.05,
    },
    "3a": ("SolarizeIncreasing", "Desaturate", "GaussianBlur"),
    "3aw": {
        "SolarizeIncreasing": 6, "Desaturate": 6, "GaussianBlur": 6, "Rotate": 3, "ShearX": 2,
        "ShearY": 2, "PosterizeIncreasing": 1, "AutoContrast": 1, "ColorIncreasing": 1,
        "SharpnessIncreasing": 1, "ContrastIncreasing": 1, "BrightnessIncreasing": 1,
        "Equalize": 1, "Invert": 1,
    },
}  # fmt: skip

GRAMMAR = (
    "rand[-m<int>][-n<int >= 1>][-p<0..1>][-mstd<float >= 0>][-mmax<int >= 1>][-inc<0|1>]"
    "[-t<weights|3a|3aw>], e.g. rand-m9-mstd0.5-inc1"
)

# Where this implementation is not timm's, operation by operation (the method card quotes it).
APPROXIMATED = {
    "geometric": "Rotate, ShearX/Y, TranslateX/YRel resample with grid_sample (bilinear, or bicubic "
    "with a = -0.75 where PIL's is -0.5); pixels from outside get the fill colour, blended at the "
    "border where PIL does not blend",
    "enhance": "Color, Contrast, Brightness, Sharpness (and Desaturate) compute in float and are "
    "not rounded to 8-bit levels after each operation (within 1/255 of PIL's)",
    "AutoContrast": "stretches each channel's float range, PIL maps 8-bit levels (within 1/255)",
    "GaussianBlur": "a true Gaussian of sigma = the radius, 3 sigma wide, edges replicated; PIL "
    "approximates it with box blurs",
}


@dataclass(frozen=True)
class RandAugmentSpec:
    """A parsed RandAugment string; field names follow timm's sections."""

    magnitude: int = 10  # m (timm: int)
    num_layers: int = 2  # n
    prob: float = 0.5  # p
    magnitude_std: float = 0.0  # mstd; inf (timm: mstd > 100) = uniform in [0, m]
    magnitude_max: int | None = None  # mmax; None = LEVEL_DENOM
    increasing: bool = False  # inc
    transforms: str = ""  # t: "" = the (increasing) default set, else a key of TRANSFORM_SETS

    @property
    def ops(self) -> tuple[str, ...]:
        chosen = TRANSFORM_SETS.get(self.transforms)
        if chosen is None:
            return RAND_INCREASING_TRANSFORMS if self.increasing else RAND_TRANSFORMS
        return tuple(chosen)

    @property
    def weights(self) -> tuple[float, ...] | None:
        chosen = TRANSFORM_SETS.get(self.transforms)
        return tuple(chosen.values()) if isinstance(chosen, dict) else None


_INTS = {"m": (0, "an int >= 0"), "n": (1, "an int >= 1"), "mmax": (1, "an int >= 1")}


def parse_rand_augment(text: str) -> RandAugmentSpec:
    """Parse timm's RandAugment string (``rand-m9-mstd0.5-inc1``), stricter than timm:
    a section timm would skip or assert on raises a ValueError naming it and the grammar."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"must be a string such as 'rand-m9-mstd0.5-inc1', got {text!r}; grammar: {GRAMMAR}")
    head, *sections = text.split("-")
    if head != "rand":
        raise ValueError(f"{text!r} must start with 'rand', got {head!r}; grammar: {GRAMMAR}")
    values: dict[str, object] = {}
    for section in sections:
        key, raw = _split(section)

        def bad(why: str, section: str = section) -> ValueError:
            return ValueError(f"{text!r}: section {section!r} {why}; grammar: {GRAMMAR}")

        if key in values:
            raise bad("is given twice")
        if key == "t":
            if raw not in TRANSFORM_SETS:
                raise bad(f"names no transform set (one of {', '.join(TRANSFORM_SETS)})")
            values[key] = raw
        elif key == "w":
            raise bad("is timm's removed weight index; timm >= 1.0 takes -tweights instead")
        elif key in _INTS:
            low, what = _INTS[key]
            if not re.fullmatch(r"\d+", raw) or int(raw) < low:
                raise bad(f"needs {what}")
            values[key] = int(raw)
        elif key == "inc":
            if raw not in ("0", "1"):
                raise bad("needs 0 or 1")
            values[key] = raw == "1"
        elif key in ("p", "mstd"):
            try:
                number = float(raw)
            except ValueError:
                number = math.nan
            if not math.isfinite(number) or number < 0 or (key == "p" and number > 1):
                raise bad("needs a number in [0, 1]" if key == "p" else "needs a number >= 0")
            values[key] = math.inf if key == "mstd" and number > 100 else number  # timm's rule
        else:
            raise bad("is unknown")
    spec = RandAugmentSpec(
        magnitude=values.get("m", int(LEVEL_DENOM)),  # type: ignore[arg-type]
        num_layers=values.get("n", 2),  # type: ignore[arg-type]
        prob=values.get("p", 0.5),  # type: ignore[arg-type]
        magnitude_std=values.get("mstd", 0.0),  # type: ignore[arg-type]
        magnitude_max=values.get("mmax"),  # type: ignore[arg-type]
        increasing=values.get("inc", False),  # type: ignore[arg-type]
        transforms=values.get("t", ""),  # type: ignore[arg-type]
    )
    weights = spec.weights
    if weights is not None and spec.num_layers > len(weights):
        raise ValueError(
            f"{text!r}: section 'n{spec.num_layers}' asks for more operations than the "
            f"{len(weights)} of -t{spec.transforms}, drawn without replacement; grammar: {GRAMMAR}"
        )
    return spec


def _split(section: str) -> tuple[str, str]:
    if section.startswith("t"):  # timm reads any section starting with t as a set name
        return "t", section[1:]
    match = re.fullmatch(r"([a-z]*)(.*)", section)
    assert match is not None  # the pattern matches any string
    return match.group(1), match.group(2)


# -- the draws ------------------------------------------------------------------------


@dataclass
class Plan:
    """Every random choice of one batch, per image (rows) and layer (columns), on the host."""

    ops: torch.Tensor  # int64 index into spec.ops
    applied: torch.Tensor  # bool: the layer's probability test passed
    magnitude: torch.Tensor  # float64, noise added and clipped
    sign: torch.Tensor  # float64, +1 or -1 (timm's _randomly_negate)
    bicubic: torch.Tensor  # bool: a geometric op's resampling when it is drawn ("random")


def draw_plan(spec: RandAugmentSpec, images: int, generator: torch.Generator) -> Plan:
    """The operations, magnitudes and signs of ``images`` images, drawn with ``generator``
    (a CPU generator) in a fixed order, so a seed fixes them on any device."""
    shape = (images, spec.num_layers)
    weights = spec.weights
    if weights is None:  # timm: np.random.choice with replacement
        ops = torch.randint(len(spec.ops), shape, generator=generator)
    else:  # without replacement, in proportion to the weights
        table = torch.tensor(weights, dtype=torch.float64).expand(images, -1)
        ops = torch.multinomial(table, spec.num_layers, replacement=False, generator=generator)
    # timm skips an op when random() > p.
    applied = torch.rand(shape, generator=generator, dtype=torch.float64) <= spec.prob
    magnitude = torch.full(shape, float(spec.magnitude), dtype=torch.float64)
    if spec.magnitude_std == math.inf:
        magnitude = magnitude * torch.rand(shape, generator=generator, dtype=torch.float64)
    elif spec.magnitude_std > 0:
        noise = torch.randn(shape, generator=generator, dtype=torch.float64)
        magnitude = magnitude + spec.magnitude_std * noise
    upper = spec.magnitude_max or LEVEL_DENOM
    magnitude = magnitude.clamp(0.0, upper)
    # timm negates when random() > 0.5.
    sign = torch.where(torch.rand(shape, generator=generator, dtype=torch.float64) > 0.5, -1.0, 1.0)
    # Drawn whatever the interpolation setting, so that it changes no other draw.
    bicubic = torch.rand(shape, generator=generator, dtype=torch.float64) < 0.5
    return Plan(ops, applied, magnitude, sign, bicubic)


def level_arg(name: str, magnitude: torch.Tensor, sign: torch.Tensor) -> torch.Tensor | None:
    """timm's LEVEL_TO_ARG for ``name``, on a vector of magnitudes (float64, host)."""
    level = magnitude / LEVEL_DENOM
    if name == "Rotate":
        return level * 30.0 * sign
    if name in ("ShearX", "ShearY"):
        return level * 0.3 * sign
    if name in ("TranslateXRel", "TranslateYRel"):
        return level * 0.45 * sign  # hparams translate_pct, 0.45 by default
    if name == "Posterize":
        return torch.trunc(level * 4)  # bits kept: severity decreases with m
    if name == "PosterizeIncreasing":
        return 4 - torch.trunc(level * 4)
    if name == "Solarize":
        return torch.trunc(level * 256).clamp(max=256)  # threshold
    if name == "SolarizeIncreasing":
        return 256 - torch.trunc(level * 256).clamp(max=256)
    if name == "SolarizeAdd":
        return torch.trunc(level * 110).clamp(max=128)
    if name in ("Color", "Contrast", "Brightness", "Sharpness"):
        return level * 1.8 + 0.1
    if name.endswith("Increasing"):  # Color, Contrast, Brightness, SharpnessIncreasing
        return (1.0 + level * 0.9 * sign).clamp(min=0.1)
    if name == "Desaturate":  # timm: 0.5 + 0.5 level, clamped, then 1 - that as the color factor
        return 1.0 - (0.5 + 0.5 * level).clamp(0.5, 1.0)
    if name == "GaussianBlur":  # radius
        return (0.1 + 1.9 * level).clamp(0.1, 2.0)
    return None  # AutoContrast, Equalize, Invert


# -- the operations, on a group of images (k, C, H, W) in [0, 1] ------------------------


def _levels(x: torch.Tensor) -> torch.Tensor:
    return (x * 255).round_().clamp_(0, 255)


def _per_image(arg: torch.Tensor) -> torch.Tensor:
    return arg.view(-1, 1, 1, 1)


def _gray(x: torch.Tensor) -> torch.Tensor:
    # PIL's convert("L") weights; a one-channel image is its own grey.
    if x.shape[1] != 3:
        return x.mean(1, keepdim=True)
    r, g, b = x.unbind(1)
    return (0.299 * r + 0.587 * g + 0.114 * b).unsqueeze(1)


def _blend(degenerate: torch.Tensor, x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    # PIL's ImageEnhance: degenerate + factor * (image - degenerate), clipped.
    return (degenerate + _per_image(factor) * (x - degenerate)).clamp_(0, 1)


def auto_contrast(x: torch.Tensor, _: torch.Tensor | None = None) -> torch.Tensor:
    low, high = x.amin((2, 3), keepdim=True), x.amax((2, 3), keepdim=True)
    flat = high <= low  # PIL leaves a one-level channel as it is
    scale = torch.where(flat, 1.0, 1.0 / (high - low).clamp(min=1e-12))
    return ((x - torch.where(flat, 0.0, low)) * scale).clamp_(0, 1)


def equalize(x: torch.Tensor, _: torch.Tensor | None = None) -> torch.Tensor:
    """PIL's ImageOps.equalize per channel, exactly, on 8-bit levels. Integer counts:
    scatter_add is exact (and torch's deterministic mode keeps it so on CUDA)."""
    k, c, h, w = x.shape
    q = _levels(x).long().view(k * c, h * w)
    hist = torch.zeros(k * c, 256, dtype=torch.long, device=x.device)
    hist.scatter_add_(1, q, torch.ones(1, dtype=torch.long, device=x.device).expand_as(q))
    last = hist.gather(1, q.amax(1, keepdim=True))  # the count of the highest level present
    step = (h * w - last) // 255
    below = hist.cumsum(1) - hist  # pixels with a lower level
    lut = (step // 2 + below) // step.clamp(min=1)
    lut = torch.where(step > 0, lut.clamp(max=255), torch.arange(256, device=x.device))
    return (lut.gather(1, q).to(x.dtype) / 255).view(k, c, h, w)


def invert(x: torch.Tensor, _: torch.Tensor | None = None) -> torch.Tensor:
    return 1 - x


def posterize(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    # Keep the `bits` highest bits of each level; 8 or more leaves the image alone.
    step = _per_image(torch.exp2(8 - bits.clamp(0, 8)))
    out = torch.div(_levels(x), step, rounding_mode="floor") * step / 255
    return torch.where(step > 1, out, x)


def solarize(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    # round(255 x) < t  <=>  255 x < t - 0.5: the level test without rounding the batch.
    return torch.where(x < _per_image(threshold - 0.5) / 255, x, 1 - x)


def solarize_add(x: torch.Tensor, add: torch.Tensor) -> torch.Tensor:
    return torch.where(x < 127.5 / 255, (x + _per_image(add) / 255).clamp_(max=1), x)


def color(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return _blend(_gray(x), x, factor)


def contrast(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    # PIL blends with the grey image's mean level, rounded to an integer level.
    mean = torch.floor(_gray(x).mean((1, 2, 3), keepdim=True) * 255 + 0.5) / 255
    return _blend(mean, x, factor)


def brightness(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return (x * _per_image(factor)).clamp_(0, 1)


def sharpness(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    # PIL's SMOOTH filter inside the image, its border pixels kept as they are.
    c = x.shape[1]
    kernel = torch.tensor([[1.0, 1, 1], [1, 5, 1], [1, 1, 1]], dtype=x.dtype, device=x.device) / 13
    smooth = F.conv2d(x, kernel.repeat(c, 1, 1, 1), groups=c)
    degenerate = x.clone()
    degenerate[..., 1:-1, 1:-1] = smooth
    return _blend(degenerate, x, factor)


def gaussian_blur(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """A separable Gaussian of each image's own sigma: one grouped convolution per axis."""
    k, c, h, w = x.shape
    radius = 6  # 3 x the largest sigma (2.0)
    taps = torch.arange(-radius, radius + 1, dtype=x.dtype, device=x.device)
    kernel = torch.exp(-0.5 * (taps / _per_image(sigma).view(-1, 1)) ** 2)
    kernel = (kernel / kernel.sum(1, keepdim=True)).repeat_interleave(c, 0)  # (k*c, taps)
    flat = x.reshape(1, k * c, h, w)
    flat = F.conv2d(F.pad(flat, (radius, radius, 0, 0), mode="replicate"), kernel.view(k * c, 1, 1, -1), groups=k * c)
    flat = F.conv2d(F.pad(flat, (0, 0, radius, radius), mode="replicate"), kernel.view(k * c, 1, -1, 1), groups=k * c)
    return flat.view(k, c, h, w)


PIXEL_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "AutoContrast": auto_contrast, "Equalize": equalize, "Invert": invert,
    "Posterize": posterize, "PosterizeIncreasing": posterize,
    "Solarize": solarize, "SolarizeIncreasing": solarize, "SolarizeAdd": solarize_add,
    "Color": color, "ColorIncreasing": color, "Desaturate": color,
    "Contrast": contrast, "ContrastIncreasing": contrast,
    "Brightness": brightness, "BrightnessIncreasing": brightness,
    "Sharpness": sharpness, "SharpnessIncreasing": sharpness, "GaussianBlur": gaussian_blur,
}  # fmt: skip
GEOMETRIC_OPS = ("Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")


def _pixel_matrices(name: str, arg: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """PIL's affine data for ``name``, (k, 2, 3): the input point of each output point,
    in pixel units (float64, host)."""
    m = torch.zeros(len(arg), 2, 3, dtype=torch.float64)
    m[:, 0, 0] = m[:, 1, 1] = 1
    if name == "ShearX":
        m[:, 0, 1] = arg
    elif name == "ShearY":
        m[:, 1, 0] = arg
    elif name == "TranslateXRel":
        m[:, 0, 2] = arg * width
    elif name == "TranslateYRel":
        m[:, 1, 2] = arg * height
    else:  # Rotate: PIL's Image.rotate, counter-clockwise about the centre
        t = -torch.deg2rad(arg)
        cos, sin = torch.cos(t), torch.sin(t)
        cx, cy = width / 2, height / 2
        m[:, 0, 0], m[:, 0, 1], m[:, 1, 0], m[:, 1, 1] = cos, sin, -sin, cos
        m[:, 0, 2] = cx - cos * cx - sin * cy
        m[:, 1, 2] = cy + sin * cx - cos * cy
    return m


def _to_theta(m: torch.Tensor, height: int, width: int) -> torch.Tensor:
    # Pixel coordinates p = S g + S (align_corners=False: g in [-1, 1] spans the pixels'
    # edges), S = diag(w/2, h/2): theta = S^-1 [A | A S 1 + b - S 1].
    s = torch.tensor([width / 2, height / 2], dtype=torch.float64)
    a, b = m[:, :, :2], m[:, :, 2]
    linear = a * s.view(1, 1, 2) / s.view(1, 2, 1)
    shift = ((a @ s) + b - s) / s
    return torch.cat([linear, shift.unsqueeze(2)], dim=2)


def _warp(x: torch.Tensor, theta: torch.Tensor, fill: torch.Tensor, mode: str = "bilinear") -> torch.Tensor:
    # Sampling (x - fill) with zero padding and adding fill back puts the fill colour
    # where the source is outside the image, in one grid_sample.
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x - fill, grid, mode=mode, padding_mode="zeros", align_corners=False) + fill


INTERPOLATIONS = ("random", "bilinear", "bicubic")


def rand_augment(
    inputs: torch.Tensor,
    spec: RandAugmentSpec | str,
    seed: int,
    fill: Sequence[float] = (128, 128, 128),
    interpolation: str = "random",
) -> torch.Tensor:
    """Apply timm's RandAugment ``spec`` to each image of ``inputs`` with its own draws.

    ``inputs`` is float ``(N, C, H, W)`` in [0, 1] on any device; the result is a new
    tensor of the same shape, dtype and device, in [0, 1]. ``seed`` fixes every choice
    (operations, whether each applies, magnitudes, signs; drawn on the host, so alike
    on every device). ``fill`` is the colour geometric operations bring in, in 0-255
    like timm's ``hparams['img_mean']`` (one value, or one per channel);
    ``interpolation`` their resampling: ``random`` (bilinear or bicubic per application,
    timm's default), ``bilinear`` or ``bicubic`` (timm's ``hparams['interpolation']``).
    """
    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"interpolation must be one of {', '.join(INTERPOLATIONS)}, got {interpolation!r}")
    if isinstance(spec, str):
        spec = parse_rand_augment(spec)
    n, c, h, w = inputs.shape
    if len(fill) not in (1, c):
        raise ValueError(f"fill has {len(fill)} values for images of {c} channels; give 1 or {c}")
    out = inputs.clone()
    if n == 0:
        return out
    plan = draw_plan(spec, n, torch.Generator().manual_seed(seed))
    # Everything the device needs, packed on the host and copied in one go: each
    # step's image rows and its per-image argument (or, for a layer's warp, 6 numbers).
    steps: list[tuple[str, int, int]] = []  # (op, or a warp's "bilinear"/"bicubic"; first row; rows)
    rows_parts: list[torch.Tensor] = []
    args_parts: list[torch.Tensor] = [torch.tensor(fill, dtype=torch.float64) / 255]
    offset = 0
    for layer in range(spec.num_layers):
        ops, applied = plan.ops[:, layer], plan.applied[:, layer]
        warp_rows, warp_m, warp_cubic = [], [], []
        for k, name in enumerate(spec.ops):
            rows = ((ops == k) & applied).nonzero().flatten()  # host tensors: no device sync
            if rows.numel() == 0:
                continue
            arg = level_arg(name, plan.magnitude[rows, layer], plan.sign[rows, layer])
            if name in GEOMETRIC_OPS:
                warp_rows.append(rows)
                warp_m.append(_pixel_matrices(name, arg, h, w))  # type: ignore[arg-type]
                warp_cubic.append(plan.bicubic[rows, layer])
                continue
            steps.append((name, offset, len(rows)))
            rows_parts.append(rows)
            args_parts.append(arg if arg is not None else torch.zeros(len(rows), dtype=torch.float64))
            offset += len(rows)
        if warp_rows:  # one warp per resampling mode for the layer's geometric operations
            rows, theta = torch.cat(warp_rows), _to_theta(torch.cat(warp_m), h, w)
            if interpolation == "random":
                cubic = torch.cat(warp_cubic).tolist()
            else:
                cubic = [interpolation == "bicubic"] * len(rows)
            for mode in ("bilinear", "bicubic"):
                pick = torch.tensor([i for i, c in enumerate(cubic) if c == (mode == "bicubic")], dtype=torch.long)
                if len(pick):
                    steps.append((mode, offset, len(pick)))
                    rows_parts.append(rows[pick])
                    args_parts.append(theta[pick].flatten())
                    offset += len(pick)
    if not steps:
        return out
    all_rows = torch.cat(rows_parts).to(inputs.device, non_blocking=True)
    all_args = torch.cat(args_parts).to(inputs.dtype).to(inputs.device, non_blocking=True)
    fill_t, cursor = all_args[: len(fill)].view(1, -1, 1, 1), len(fill)
    for name, first, count in steps:
        index = all_rows[first : first + count]
        group = out.index_select(0, index)
        if name in ("bilinear", "bicubic"):
            theta = all_args[cursor : cursor + 6 * count].view(count, 2, 3)
            cursor += 6 * count
            result = _warp(group, theta, fill_t, name).clamp_(0, 1)
        else:
            result = PIXEL_OPS[name](group, all_args[cursor : cursor + count])
            cursor += count
        out.index_copy_(0, index, result)
    return out
