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
  :meth:`Algorithm.variants` for measured ``auto`` (:mod:`slipstream.variants`).
- :func:`parse_duration_option` parses a plugin's duration config key with an
  error that names the algorithm and the key.

Names are imported on first use (PEP 562): ``import slipstream`` and the CLI's
listing commands do not pay for torch until a name that needs it is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .algorithm import Algorithm
    from .callback import Callback
    from .checkpoint import load_checkpoint
    from .checks import check_plugin_options, check_value, plugin_option
    from .duration import Duration, DurationError, parse_duration_option
    from .errors import CheckpointError, ConfigError, PluginError, SlipstreamError
    from .hookspecs import NOT_MINE, hookimpl
    from .images import to_unit_float
    from .options import TrainerOptions
    from .peak_flops import DTYPES
    from .rundir import RunDir
    from .seeds import batch_generator, batch_seed
    from .state import State, Timestamp, unwrap_model
    from .tracking import flatten, numbers
    from .trainer import Trainer
    from .variants import Variant

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "Algorithm": "algorithm",
    "Callback": "callback",
    "CheckpointError": "errors",
    "ConfigError": "errors",
    "DTYPES": "peak_flops",
    "Duration": "duration",
    "DurationError": "duration",
    "NOT_MINE": "hookspecs",
    "PluginError": "errors",
    "RunDir": "rundir",
    "SlipstreamError": "errors",
    "State": "state",
    "Timestamp": "state",
    "Trainer": "trainer",
    "TrainerOptions": "options",
    "batch_generator": "seeds",
    "check_plugin_options": "checks",
    "check_value": "checks",
    "batch_seed": "seeds",
    "flatten": "tracking",
    "hookimpl": "hookspecs",
    "load_checkpoint": "checkpoint",
    "numbers": "tracking",
    "parse_duration_option": "duration",
    "plugin_option": "checks",
    "requested_impl": "optim",
    "to_unit_float": "images",
    "unwrap_model": "state",
    "Variant": "variants",
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
    "batch_seed",
    "flatten",
    "hookimpl",
    "load_checkpoint",
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
