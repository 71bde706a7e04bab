"""Slipstream: a PyTorch training engine whose speed-up techniques are plugins.

The public API, which plugins may import:

- :class:`Trainer` runs the loop (its run-level settings are :class:`TrainerOptions`);
  :class:`State` is what every hook receives.
- :class:`Algorithm` is the base class of a technique; :data:`hookimpl` marks its
  hook methods (the contract is :mod:`slipstream.hookspecs`).
- :class:`Duration` parses ``10ep``, ``0.3dur``, ``15m`` ...
- :func:`batch_seed` / :func:`batch_generator`: the random stream of one training
  batch of one rank, for plugins that draw random numbers (same seed, same batches;
  bit-exact on resume).
- :func:`parse_duration_option` parses a plugin's duration config key with an
  error that names the algorithm and the key.
- :func:`to_unit_float` turns a ``uint8`` or float image batch into float in [0, 1],
  for plugins that transform pixels at ``batch_start``.
"""

from .algorithm import Algorithm
from .checkpoint import load_checkpoint
from .duration import Duration, DurationError, parse_duration_option
from .errors import CheckpointError, ConfigError, PluginError, SlipstreamError
from .hookspecs import hookimpl
from .images import to_unit_float
from .options import TrainerOptions
from .seeds import batch_generator, batch_seed
from .state import State, Timestamp, unwrap_model
from .trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "Algorithm",
    "CheckpointError",
    "ConfigError",
    "Duration",
    "DurationError",
    "PluginError",
    "SlipstreamError",
    "State",
    "Timestamp",
    "Trainer",
    "TrainerOptions",
    "batch_generator",
    "batch_seed",
    "hookimpl",
    "load_checkpoint",
    "parse_duration_option",
    "to_unit_float",
    "unwrap_model",
]
