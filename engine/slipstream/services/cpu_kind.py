"""What kind of CPU this is, as far as training speed goes: the one detector that the
engine, the plugins and the tests ask.

The kinds differ where it matters for training: whether bf16 is computed in hardware.

- ``avx2``: no AVX-512. bf16 is emulated, about 13x slower than fp32 on a ResNet step
  (AMD EPYC Zen 3, older Xeons).
- ``avx512``: AVX-512 without its BF16 instructions: bf16 still emulated.
- ``avx512_bf16``: AVX-512 BF16 (AMD Zen 4/5, Cooper Lake): native bf16 dot products.
- ``amx``: AMX tiles (Intel Sapphire Rapids and later): a bf16 matmul peak about 8x fp32's.
- ``other``: not x86-64 (Arm, ...): oneDNN's own answer decides whether bf16 is native.

``SLIPSTREAM_CPU_KIND=<kind>`` makes the engine act as if it ran on that kind: what
``auto`` settings choose and which warnings a run gives follow the kind named, while
the arithmetic still runs on the real CPU (bf16 "as amx" on an AVX2 machine is
emulated, so slow). Contributors use it to run the test suite as another kind
(docs/contributing.md); the kind-dependent tests run under every kind anyway.
"""

from __future__ import annotations

import functools
import os

import torch

from slipstream.errors import ConfigError

ENV = "SLIPSTREAM_CPU_KIND"
KINDS = ("avx2", "avx512", "avx512_bf16", "amx", "other")
NATIVE_BF16 = ("avx512_bf16", "amx")


def _asked(check: object) -> bool:
    """One of torch's capability queries, answered False where this build lacks it."""
    try:
        return bool(check()) if callable(check) else False
    except RuntimeError:  # e.g. a build without oneDNN
        return False


def _torch_says(name: str) -> bool:
    return _asked(getattr(torch.cpu, name, None))  # private cpuinfo queries, present since torch 2.1


@functools.lru_cache(maxsize=1)
def _onednn_bf16() -> bool:
    """oneDNN's own test: without it oneDNN is not used for bf16 at all and PyTorch
    falls back to generic kernels (a CIFAR-stem ResNet-18 step ran 12x slower in bf16
    than in fp32 on an AVX2-only AMD EPYC)."""
    return _asked(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None))


@functools.lru_cache(maxsize=1)
def detected_cpu_kind() -> str:
    """The kind of the CPU this process runs on, whatever ``SLIPSTREAM_CPU_KIND`` says:
    for what only the real hardware can show (a oneDNN kernel's fault, bf16 numerics)."""
    if _torch_says("_is_amx_tile_supported") and _onednn_bf16():
        return "amx"
    if _torch_says("_is_avx512_bf16_supported") and _onednn_bf16():
        return "avx512_bf16"
    if _torch_says("_is_avx512_supported"):
        return "avx512"
    if _torch_says("_is_avx2_supported"):
        return "avx2"
    return "other"


def cpu_kind() -> str:
    """The kind the engine acts on: ``SLIPSTREAM_CPU_KIND`` where it is set, else the
    detected one. A value that is no kind is an error naming the allowed ones."""
    named = os.environ.get(ENV, "").strip()
    if not named:
        return detected_cpu_kind()
    if named not in KINDS:
        raise ConfigError(f"{ENV}={named!r} is not a CPU kind; allowed: {', '.join(KINDS)} (or unset: detect)")
    return named


def native_bf16() -> bool:
    """Whether bf16 convolutions and matmuls run in hardware on this CPU (as
    :func:`cpu_kind` sees it), so that ``auto`` may consider bf16 at all."""
    kind = cpu_kind()
    if kind == "other":
        return _onednn_bf16()
    return kind in NATIVE_BF16


def describe_cpu_kind() -> str:
    """The kind for a report line, saying so when it is assumed rather than detected."""
    kind, detected = cpu_kind(), detected_cpu_kind()
    return kind if kind == detected else f"{kind} (as {ENV} says; detected {detected})"
