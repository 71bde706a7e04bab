"""Where a diverged run went non-finite, found after the fact.

The divergence check (:mod:`slipstream.services.divergence`) reads the losses at the
logging interval; only when one is not finite does this module look at the model:
which parameters hold a NaN or an infinity in their gradient (when the last step's
gradients are still there: mid-accumulation, or kept by a plugin) or their weight,
with the compute dtype, memory format and input size in force. Nothing here runs
while the losses are finite, so the loop pays nothing for it.

A NaN gradient runs backwards through the network, from the layer that made it to
the input, and the next update puts it into those layers' weights. So when some
parameters are non-finite and others are not, the first to go non-finite is the
one nearest the output, and that is the one named first. When every parameter is
non-finite the check came too late to tell (the next forward spread it everywhere),
and the message says so.

The hint follows from what was found. One fault is known by its pattern: on x86
CPUs, oneDNN's bf16 channels-last convolution can return a non-finite weight
gradient for a convolution whose input is 1x1 (a 3x3 stride-2 convolution at the
end of an ImageNet-stem network trained at 16 px). When the run has that pattern,
the suspect convolution is run on its own, at the same shapes, and the hint says
whether the fault reproduced here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from slipstream.state import State

# Parameters named in the message (the summary keeps a longer list).
SHOWN = 3
LISTED = 20
# Calls of the suspect convolution when probing for the oneDNN fault.
PROBE_CALLS = 5


def _local(t: torch.Tensor) -> torch.Tensor:
    # A DTensor (FSDP2) is checked on this rank's shard: no collective.
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def nonfinite_names(named: Sequence[tuple[str, torch.Tensor | None]]) -> list[str]:
    """The names whose tensor holds a NaN or an infinity (None is skipped), in the
    given order; one device sync in all."""
    present = [(n, _local(t)) for n, t in named if t is not None and t.is_floating_point()]
    if not present:
        return []
    checks = [t.isfinite().all() for _, t in present]
    try:
        finite = torch.stack(checks).tolist()  # one sync
    except RuntimeError:  # parameters on several devices (an offloading wrap)
        finite = [bool(c) for c in checks]
    return [n for (n, _), ok in zip(present, finite, strict=True) if not ok]


def conv_inputs(model: nn.Module, input_shape: Sequence[int]) -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    """Each convolution of ``model`` with the input shape it sees for a batch of
    ``input_shape``, found on a copy on the ``meta`` device (no compute, nothing of
    the model touched). Empty when the copy cannot run."""
    from slipstream.services.flops import meta_copy

    try:
        copy = meta_copy(model)
    except Exception:  # a model that cannot be copied: the hint goes without it
        return {}
    seen: dict[str, tuple[nn.Module, tuple[int, ...]]] = {}
    originals = dict(model.named_modules())
    handles = []
    for name, module in copy.named_modules():
        if isinstance(module, nn.modules.conv._ConvNd) and name in originals:

            def record(mod: nn.Module, args: Any, _name: str = name) -> None:
                if args and isinstance(args[0], torch.Tensor):
                    seen[_name] = (originals[_name], tuple(args[0].shape))

            handles.append(module.register_forward_pre_hook(record))
    try:
        with torch.no_grad():
            copy.eval()(torch.empty(tuple(input_shape), device="meta"))
    except Exception:  # a model whose forward needs more than a tensor
        pass
    finally:
        for handle in handles:
            handle.remove()
    return seen


def probe_conv_fault(conv: nn.Module, input_shape: Sequence[int], calls: int = PROBE_CALLS) -> int:
    """How many of ``calls`` bf16 autocast, channels-last calls of a convolution
    shaped like ``conv`` (fresh weights) on an input of ``input_shape`` return a
    non-finite weight gradient on this CPU: the oneDNN fault of the module docstring."""
    assert isinstance(conv, nn.Conv2d)
    probe = nn.Conv2d(
        conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
        conv.dilation, conv.groups, conv.bias is not None,
    ).to(memory_format=torch.channels_last)
    x = torch.randn(*input_shape).to(memory_format=torch.channels_last)
    bad = 0
    for _ in range(calls):
        probe.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16):
            out = probe(x)
        out.float().square().mean().backward()
        bad += int(not torch.isfinite(probe.weight.grad).all())
    return bad


def _dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.") if dtype is not None else "float32"


def _format_name(memory_format: torch.memory_format) -> str:
    return "channels-last (NHWC)" if memory_format == torch.channels_last else "NCHW (contiguous)"


def _shown(names: Iterable[str], total: int) -> str:
    names = list(names)
    text = ", ".join(names[:SHOWN])
    return text + (f" and {total - SHOWN} more" if total > SHOWN else "")


def locate(state: State) -> dict[str, Any]:
    """What was non-finite when the run diverged, and where to look: a record for
    ``summary.json`` (``parameters``, ``found_in``, ``compute_dtype``,
    ``memory_format``, ``input_size``, ``hint``) and its ``message``."""
    model = state.unwrapped_model
    params = list(model.named_parameters())
    total = len(params)
    # Nearest the output first: where a gradient goes non-finite first.
    backward_order = list(reversed(params))
    grads = nonfinite_names([(n, p.grad) for n, p in backward_order])
    weights = nonfinite_names([(n, p.detach()) for n, p in backward_order])
    found_in, names = ("gradient", grads) if grads else ("weight", weights)
    inputs = state.batch[0] if isinstance(state.batch, (tuple, list)) and state.batch else None
    input_shape = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else None
    record: dict[str, Any] = {
        "step": state.timestamp.batch,  # when it was checked, at or after the first bad loss
        "found_in": found_in if names else None,
        "parameters": names[:LISTED],
        "nonfinite_parameters": len(names),
        "total_parameters": total,
        "compute_dtype": _dtype_name(state.compute_dtype),
        "memory_format": _format_name(state.input_memory_format),
        "input_size": list(input_shape[2:]) if input_shape is not None else None,
    }
    context = (
        f"computing in {record['compute_dtype']}, {record['memory_format']}, input "
        + ("x".join(map(str, record["input_size"])) if record["input_size"] else "of unknown size")
    )
    # Non-finite from the output back: the loss (or the output layer) went first,
    # and backward spread it. Finite near the output but not deeper in: it started
    # inside, at the deepest non-finite one.
    inside = bool(names) and backward_order[0][0] not in names
    record["origin"] = (
        None if not names else (names[0] if inside else "the loss (spread back from the output)")
    )
    if not names:
        where = f"no parameter is non-finite yet (the loss went first), {context}"
    elif inside:
        where = (
            f"the first non-finite {found_in} is {names[0]} (the deepest of {len(names)} of "
            f"{total} parameters, the layers after it are finite: {_shown(names, len(names))}), "
            f"{context}"
        )
    else:
        where = (
            f"non-finite {found_in}s in "
            + (f"all {total}" if len(names) == total else f"{len(names)} of {total}")
            + " parameters, from the output back "
            f"({_shown(names, len(names))}): the loss or the output went first and backward spread "
            f"it by step {record['step']}, {context}"
        )
    record["hint"] = _hint(state, model, names, inside, input_shape, record)
    record["message"] = where
    return record


def _hint(
    state: State,
    model: nn.Module,
    names: list[str],
    inside: bool,
    input_shape: tuple[int, ...] | None,
    record: dict[str, Any],
) -> str:
    channels_last = state.input_memory_format == torch.channels_last
    if (
        state.compute_dtype == torch.bfloat16
        and channels_last
        and state.device.type == "cpu"
        and input_shape is not None
        and len(input_shape) == 4
    ):
        # A wrap that cannot be copied (FSDP2) left a meta copy for the FLOP counter.
        convs = conv_inputs(state.flops_model or model, (1, *input_shape[1:]))
        one_by_one = [
            (name, conv, shape)
            for name, (conv, shape) in convs.items()
            if isinstance(conv, nn.Conv2d) and len(shape) == 4 and shape[2] * shape[3] == 1
        ]
        if one_by_one:
            # The known case is a 3x3 (stride-2) convolution: wider kernels first.
            one_by_one.sort(key=lambda item: -item[1].kernel_size[0] * item[1].kernel_size[1])
            name, conv, shape = one_by_one[0]
            batch = (input_shape[0], *shape[1:])
            bad = probe_conv_fault(conv, batch)
            record["suspect"] = {
                "module": name, "input": list(batch), "probe_calls": PROBE_CALLS, "probe_nonfinite": bad,
                "also_1x1_input": [n for n, _, _ in one_by_one[1:]],
            }
            cure = (
                "train in fp32 (drop mixed_precision), or NCHW (drop channels_last), or at a "
                "larger data.image_size (or image_size_curriculum's smallest size) so that no "
                "convolution sees a 1x1 map"
            )
            if bad:
                return (
                    f"{name} sees a 1x1 input in bf16 channels-last, and on this CPU that "
                    f"convolution alone returned a non-finite weight gradient in {bad} of "
                    f"{PROBE_CALLS} calls (a oneDNN fault, not the learning rate): {cure}"
                )
            return (
                f"{name} sees a 1x1 input in bf16 channels-last, where oneDNN has a known fault "
                f"(it did not reproduce in {PROBE_CALLS} calls here): {cure}; else lower "
                "optimizer.lr or add grad_clipping"
            )
    if inside:
        return (
            f"look at {names[0]}: its layer went non-finite while others did not (its "
            "initialisation, its inputs, a kernel's fault); grad_clipping may hold it, "
            "a lower optimizer.lr rarely does"
        )
    if state.compute_dtype == torch.float16:
        return (
            "float16 overflows above 65504: use bf16 (algorithms.mixed_precision.dtype=bf16) "
            "or lower optimizer.lr"
        )
    return "lower optimizer.lr or add grad_clipping"
