"""Slipstream: a PyTorch training engine whose speed-up techniques are plugins.

The public API, which plugins may import:

- :class:`Trainer` runs the loop (its run-level settings are :class:`TrainerOptions`);
  :class:`State` is what every hook receives.
- :class:`Algorithm` is the base class of a technique, :class:`Callback` of an
  observer (logger, profiler, early stopping); :data:`hookimpl` marks their hook
  methods (the contract is :mod:`slipstream.hookspecs`).
- :class:`RunDir` names the files of a run directory (``summary.json``,
  ``config.yaml``, ``checkpoints/best.pt`` ...), for plugins that read them.
- :class:`Duration` parses ``10ep``, ``0.3dur``, ``15m`` ...
- :func:`flatten` and :func:`numbers` turn configs and metrics records into the
  flat keys and numbers experiment trackers take (for logger callbacks).
- :func:`to_unit_float` turns a ``uint8`` or float image batch into float in [0, 1],
  for plugins that transform pixels at ``batch_start``.
- :func:`batch_seed` / :func:`batch_generator`: the random stream of one training
  batch of one rank (and, with ``stream``, of one consumer), for plugins that draw
  random numbers (same seed, same batches; bit-exact on resume).
- :func:`plugin_option` declares a plugin config field with its rule (range, finite,
  whole number, one of ...), :func:`check_plugin_options` applies the rules (first
  thing in the config's ``__post_init__``) and :func:`check_value` one rule, for a
  functional API.
- :class:`Variant`: one way an algorithm can run, declared by
  :meth:`Algorithm.variants` for measured ``auto`` (:mod:`slipstream.plugins.variants`).
- :func:`cpu_kind` / :func:`native_bf16`: what kind of CPU the engine acts on
  (``avx2``, ``avx512``, ``avx512_bf16``, ``amx``; ``SLIPSTREAM_CPU_KIND`` overrides
  the detected one) and whether bf16 is computed in hardware there.
- :func:`parse_duration_option` parses a plugin's duration config key with an
  error that names the algorithm and the key.

Names are imported on first use (PEP 562): ``import slipstream`` and the CLI's
listing commands do not pay for torch until a name that needs it is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slipstream.config.options import DTYPES, TrainerOptions
    from slipstream.duration import Duration, DurationError, parse_duration_option
    from slipstream.errors import CheckpointError, ConfigError, PluginError, SlipstreamError
    from slipstream.hookspecs import NOT_MINE, hookimpl
    from slipstream.images import to_unit_float
    from slipstream.plugins.algorithm import Algorithm
    from slipstream.plugins.callback import Callback
    from slipstream.plugins.checks import check_plugin_options, check_value, plugin_option
    from slipstream.plugins.variants import Variant
    from slipstream.run.checkpoint import load_checkpoint
    from slipstream.run.directory import RunDir
    from slipstream.run.tracking import flatten, numbers
    from slipstream.seeds import batch_generator, batch_seed
    from slipstream.services.cpu_kind import cpu_kind, native_bf16
    from slipstream.state import State, Timestamp, unwrap_model
    from slipstream.trainer import Trainer

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "Algorithm": "plugins.algorithm",
    "Callback": "plugins.callback",
    "CheckpointError": "errors",
    "ConfigError": "errors",
    "DTYPES": "config.options",
    "Duration": "duration",
    "DurationError": "duration",
    "NOT_MINE": "hookspecs",
    "PluginError": "errors",
    "RunDir": "run.directory",
    "SlipstreamError": "errors",
    "State": "state",
    "Timestamp": "state",
    "Trainer": "trainer",
    "TrainerOptions": "config.options",
    "batch_generator": "seeds",
    "check_plugin_options": "plugins.checks",
    "check_value": "plugins.checks",
    "cpu_kind": "services.cpu_kind",
    "batch_seed": "seeds",
    "flatten": "run.tracking",
    "hookimpl": "hookspecs",
    "load_checkpoint": "run.checkpoint",
    "meta_copy": "services.flops",
    "native_bf16": "services.cpu_kind",
    "numbers": "run.tracking",
    "parse_duration_option": "duration",
    "plugin_option": "plugins.checks",
    "requested_impl": "optim",
    "to_unit_float": "images",
    "unwrap_model": "state",
    "Variant": "plugins.variants",
}

__all__ = [
    "Algorithm",
    "Callback",
    "CheckpointError",
    "ConfigError",
    "DTYPES",
    "Duration",
    "DurationError",
    "NOT_MINE",
    "PluginError",
    "RunDir",
    "SlipstreamError",
    "State",
    "Timestamp",
    "Trainer",
    "TrainerOptions",
    "Variant",
    "batch_generator",
    "check_plugin_options",
    "check_value",
    "cpu_kind",
    "batch_seed",
    "flatten",
    "hookimpl",
    "load_checkpoint",
    "meta_copy",
    "native_bf16",
    "numbers",
    "parse_duration_option",
    "plugin_option",
    "requested_impl",
    "to_unit_float",
    "unwrap_model",
]
assert sorted(__all__) == sorted(_EXPORTS)  # one list for readers and linters, one for imports


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'slipstream' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # once: later look-ups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
