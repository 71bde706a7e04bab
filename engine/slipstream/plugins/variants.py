"""Measured ``auto``: the variants plugins can run in, chosen by timing the run's own step.

Whether bf16 or channels-last makes a step faster depends on the model and the
machine, not only on the device's feature flags (bf16 on AMX ran ResNet-18 at 32 px
1.5x *slower* than fp32). So a plugin whose setting is ``auto`` declares the variants
it can run in (:meth:`Algorithm.variants`), and at fit start, before ``init``, the
engine:

1. takes the choice stored in the checkpoint when the run resumes (bit-exact resume);
2. else the cached choice for this machine, torch version, model, optimizer, input
   shape and set of variants (``$XDG_CACHE_HOME/slipstream/auto_variants.json``,
   beside the peak-FLOP/s cache);
3. else measures: every combination of the declared variants trains a few whole steps
   (the plugins' hooks, forward, loss, backward, optimizer step) on deep copies of
   the model and optimizer with the run's first batch, a warm-up round and then timed
   rounds interleaved (A B C D A B C D ...), the fastest step of each kept. The random
   generators (torch, CUDA, Python, NumPy, the loader's) are put back afterwards, so
   the run's weights, optimizer state and random streams are exactly those of a run
   that did not measure.

A variant that changes the numerics declares a ``margin``: it is taken only where its
step is that much faster (bf16: 10 %). The engine tells each plugin its variant with
:meth:`Algorithm.use_variant` before ``init``; the plugins never see the measurement.
The engine names no plugin here: a third-party plugin declares variants the same way.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import random
import sys
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slipstream import hookspecs
from slipstream.plugins.dispatch import plugin_manager
from slipstream.services.peak_flops import cache_path as peak_flops_cache
from slipstream.services.peak_flops import device_label, machine_key, read_cache
from slipstream.services.peak_flops import write_cache as store_cache
from slipstream.state import State, unwrap_model

__all__ = [
    "CACHE_FILE",
    "Variant",
    "cache_path",
    "choose_variants",
    "declared_variants",
    "pick",
]

CACHE_FILE = Path("slipstream") / "auto_variants.json"
DEFAULT_WARMUP_STEPS = 1
DEFAULT_TIMED_STEPS = 2
# After the first timed round a combination this much slower than the best is dropped:
# no noise on a shared machine makes up for it, and its steps cost the most.
DROP_FACTOR = 1.5
# From the second timed round on, a winner this far ahead ends the measurement early.
CLEAR_FACTOR = 1.25


@dataclass(frozen=True)
class Variant:
    """One way a plugin can run. ``margin``: how much faster (0.1: 10 %) a step must
    be with this variant than without it for the engine to take it, for a variant that
    changes the numerics (a reduced precision); 0 for one that only changes speed."""

    name: str
    margin: float = 0.0

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"a variant needs a name, got {self.name!r}")
        if not 0 <= self.margin < 10:
            raise ValueError(f"variant {self.name!r}: margin must be in [0, 10), got {self.margin!r}")


def as_variants(items: Iterable[Variant | str]) -> list[Variant]:
    return [v if isinstance(v, Variant) else Variant(str(v)) for v in items]


def declared_variants(plugins: Sequence[Any], state: State) -> dict[str, list[Variant]]:
    """``{plugin name: its variants}`` for the plugins that have a choice to make (two
    variants or more), in the run's order. The first variant is each plugin's fallback."""
    out: dict[str, list[Variant]] = {}
    for plugin in plugins:
        declare = getattr(plugin, "variants", None)
        if declare is None:
            continue
        variants = as_variants(declare(state) or ())
        if len(variants) >= 2:
            names = [v.name for v in variants]
            if len(set(names)) != len(names):
                raise ValueError(f"{plugin.name}: variants must have distinct names, got {names}")
            out[plugin.name] = variants
    return out


def combo_label(combo: Mapping[str, str]) -> str:
    return ",".join(f"{name}={variant}" for name, variant in combo.items())


def pick(
    timings: Mapping[str, float],
    combos: Sequence[Mapping[str, str]],
    margins: Mapping[str, Mapping[str, float]],
) -> dict[str, str]:
    """The combination with the shortest step once each variant's margin is charged:
    a step time is multiplied by ``1 + margin`` for every variant in it that has one, so
    bf16 (margin 0.1) wins only where it is more than 10 % faster than the best
    combination without it. Ties go to the earlier combination (the fallbacks first).
    Combinations missing from ``timings`` (dropped as too slow) are not candidates."""
    best, best_cost = dict(combos[0]), float("inf")
    for combo in combos:
        took = timings.get(combo_label(combo))
        if took is None:
            continue
        cost = took * _penalty(combo, margins)
        if cost < best_cost:
            best, best_cost = dict(combo), cost
    return best


def _penalty(combo: Mapping[str, str], margins: Mapping[str, Mapping[str, float]]) -> float:
    factor = 1.0
    for plugin, variant in combo.items():
        factor *= 1.0 + margins[plugin].get(variant, 0.0)
    return factor


# -- the cache -----------------------------------------------------------------------


def cache_path() -> Path:
    """``$XDG_CACHE_HOME/slipstream/auto_variants.json`` (``~/.cache`` without it),
    beside the peak-FLOP/s cache. Delete the file to measure again."""
    return peak_flops_cache(CACHE_FILE)


def model_fingerprint(model: torch.nn.Module) -> str:
    """The model's class and a hash of its parameter and buffer names, shapes and
    dtypes: two models of one class and different widths get different entries."""
    model = unwrap_model(model)
    digest = hashlib.blake2b(digest_size=6)
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    return f"{type(model).__name__}#{digest.hexdigest()}"


def describe_shape(batch: Any) -> str:
    inputs = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if isinstance(inputs, torch.Tensor):
        return f"{tuple(inputs.shape)}:{str(inputs.dtype).removeprefix('torch.')}"
    return type(inputs).__name__


def cache_key(state: State, model_name: str, batch: Any, declared: Mapping[str, list[Variant]]) -> str:
    variants = ";".join(f"{p}:{'/'.join(v.name for v in vs)}" for p, vs in declared.items())
    return " | ".join(
        [
            machine_key(state.device),
            f"model={model_name} {model_fingerprint(state.model)}",
            f"optimizer={type(state.optimizer).__name__}",
            f"input={describe_shape(batch)}",
            f"variants={variants}",
        ]
    )


def _write_cache(path: Path, key: str, entry: dict[str, Any]) -> None:
    cache = read_cache(path)
    cache[key] = entry
    store_cache(path, cache, "the auto choice", "the next run measures again and may choose differently")


def _generators(loader: Any) -> list[torch.Generator]:
    found = []
    for owner in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


class _KeepRandomStreams:
    """Puts back every random generator a run draws from, after the measurement."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __enter__(self) -> None:
        self.torch = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        self.python = random.getstate()
        self.numpy = np.random.get_state()
        self.generators = [(g, g.get_state()) for g in _generators(self.loader)]

    def __exit__(self, *exc: Any) -> None:
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        for generator, saved in self.generators:
            generator.set_state(saved)


def first_batch(loader: Any) -> Any | None:
    """The loader's first batch, or None when taking it would use the loader up (a
    one-shot iterator) or the loader is empty."""
    if loader is None:
        return None
    try:
        iterator = iter(loader)
    except TypeError:
        return None
    if iterator is loader:
        return None
    return next(iterator, None)


# -- the measurement -------------------------------------------------------------------


class _Trial:
    """One combination on its own copies: model, optimizer, plugins, a hook relay with
    the engine's default steps and the declaring plugins only."""

    def __init__(
        self, state: State, plugins: Sequence[Any], combo: Mapping[str, str], steps: Any, prepare: Any
    ) -> None:
        model, optimizer = copy.deepcopy((state.unwrapped_model, state.optimizer))
        self.state = State(
            model=model,
            optimizer=optimizer,
            max_duration=state.max_duration,
            device=state.device,
            train_loader=state.train_loader,
            loss_fn=state.loss_fn,
            seed=state.seed,
            config=state.config,
        )
        self.state.batches_per_epoch = state.batches_per_epoch
        self.state.global_batch_size = state.global_batch_size
        self.prepare = prepare
        self.pm = plugin_manager(hookspecs.PROJECT, hookspecs)
        self.pm.register(steps, name="engine.steps")
        # Only the plugins that have a choice: the others (a schedule, a logger) act
        # the same in every combination, and may expect a whole run around them.
        for plugin in reversed(plugins):
            if plugin.name in combo:
                twin = copy.deepcopy(plugin)
                twin.use_variant(combo[plugin.name])
                self.pm.register(twin, name=plugin.name)
        self.pm.hook.init(state=self.state)
        self.times: list[float] = []

    def step(self, batch: Any) -> float:
        state, hook = self.state, self.pm.hook
        sync = state.device.type == "cuda"
        if sync:
            torch.cuda.synchronize(state.device)
        started = time.perf_counter()
        state.batch = batch
        hook.batch_start(state=state)
        self.prepare(state)
        hook.before_forward(state=state)
        state.outputs = hook.forward(state=state)
        hook.after_forward(state=state)
        state.loss = hook.compute_loss(state=state)
        hook.after_loss(state=state)
        hook.before_backward(state=state)
        hook.backward(state=state)
        hook.after_backward(state=state)
        if hook.should_step(state=state):
            hook.before_optimizer_step(state=state)
            hook.optimizer_step(state=state)
            state.optimizer.zero_grad(set_to_none=True)
            state.timestamp.optimizer_steps += 1
            hook.after_optimizer_step(state=state)
        state.timestamp.batch += 1
        hook.batch_end(state=state)
        if sync:
            torch.cuda.synchronize(state.device)
        else:
            # The host clock needs the step's work done: read the loss once.
            float(state.loss.detach().float())
        return time.perf_counter() - started


def measure(
    state: State,
    plugins: Sequence[Any],
    combos: Sequence[Mapping[str, str]],
    batch: Any,
    *,
    steps: Any,
    prepare: Any,
    warmup: int = DEFAULT_WARMUP_STEPS,
    timed: int = DEFAULT_TIMED_STEPS,
    penalty: Mapping[str, float] | None = None,
) -> dict[str, list[float]]:
    """The times (seconds) of up to ``timed`` training steps of each combination, after
    ``warmup`` untimed ones, in interleaved rounds; a combination more than
    :data:`DROP_FACTOR` slower than the best after the first timed round is dropped,
    and the rounds end early once the choice is clear. ``penalty``: each
    combination's ``1 + margin`` factor (:func:`pick`)."""
    penalty = penalty or {}
    with warnings.catch_warnings():
        # The copies' set-up repeats what the run itself says at init.
        warnings.simplefilter("ignore")
        trials = {combo_label(c): _Trial(state, plugins, c, steps, prepare) for c in combos}
        for _ in range(warmup):
            for trial in trials.values():
                trial.step(batch)
        live = dict(trials)
        for round_ in range(timed):
            for trial in live.values():
                trial.times.append(trial.step(batch))
            if round_ == 0 and len(live) > 2:
                fastest = min(min(t.times) for t in live.values())
                live = {k: t for k, t in live.items() if min(t.times) <= DROP_FACTOR * fastest}
            if round_ >= 1 and _clear(live, penalty):
                break
    return {label: list(trial.times) for label, trial in trials.items()}


def _clear(live: Mapping[str, _Trial], penalty: Mapping[str, float]) -> bool:
    """Whether, after two timed rounds or more, one combination (margins charged)
    beats every other still timed by :data:`CLEAR_FACTOR`: more rounds would not
    change the choice, only cost."""
    costs = sorted(min(t.times) * penalty.get(k, 1.0) for k, t in live.items())
    return len(costs) < 2 or costs[1] >= CLEAR_FACTOR * costs[0]


def choose_variants(
    state: State,
    plugins: Sequence[Any],
    *,
    model_name: str,
    steps: Any,
    prepare: Any,
    move: Any,
    pinned: Mapping[str, str] | None = None,
    measure_on: bool = True,
    warmup: int = DEFAULT_WARMUP_STEPS,
    timed: int = DEFAULT_TIMED_STEPS,
    cache: Path | None = None,
    write_cache: bool = True,
) -> dict[str, Any] | None:
    """Decide the variant of every plugin that declares some, tell each plugin its
    own (``use_variant``), and return the record for ``summary.json`` (None when no
    plugin has a choice). ``pinned`` is a resumed checkpoint's choice; ``steps`` the
    engine's default steps, ``prepare`` its normalisation, ``move`` its batch mover."""
    started = time.perf_counter()
    declared = declared_variants(plugins, state)
    if not declared:
        return None
    margins = {p: {v.name: v.margin for v in vs} for p, vs in declared.items()}
    fallback = {p: vs[0].name for p, vs in declared.items()}
    record: dict[str, Any] = {
        "variants": {p: [v.name for v in vs] for p, vs in declared.items()},
        "margins": {p: {k: m for k, m in ms.items() if m} for p, ms in margins.items() if any(ms.values())},
    }
    choice: dict[str, str] | None = None
    if pinned is not None:
        choice = {p: pinned[p] if pinned.get(p) in margins[p] else fallback[p] for p in declared}
        record["method"] = "checkpoint"
    elif not measure_on:
        choice, record["method"] = fallback, "fallback (trainer.autotune=false)"
    if choice is None:
        with _KeepRandomStreams(state.train_loader):
            batch = first_batch(state.train_loader)
        if batch is None:
            choice, record["method"] = fallback, "fallback (no batch to time: the training data is a one-shot iterator)"
        else:
            batch = move(batch)
            path = cache or cache_path()
            key = cache_key(state, model_name, batch, declared)
            entry = read_cache(path).get(key)
            if isinstance(entry, dict) and _valid_choice(entry.get("choice"), margins):
                choice = dict(entry["choice"])
                record.update(method="cache", cache=str(path), cached_timings_ms=entry.get("timings_ms"))
                record["measured_at"] = entry.get("measured_at")
            else:
                products = itertools.product(*record["variants"].values())
                combos = [dict(zip(declared, names, strict=True)) for names in products]
                penalty = {combo_label(c): _penalty(c, margins) for c in combos}
                try:
                    with _KeepRandomStreams(state.train_loader):
                        seconds = measure(
                            state, plugins, combos, batch, steps=steps, prepare=prepare, warmup=warmup, timed=timed,
                            penalty=penalty,
                        )
                except torch.OutOfMemoryError:
                    # One copy of the model and optimizer per combination did not fit
                    # beside the run's own: run the fallbacks rather than fail.
                    seconds = None
                finally:
                    if state.device.type == "cuda":
                        torch.cuda.empty_cache()  # the copies' memory, back for the run
            if choice is None and seconds is None:
                choice = fallback
                record["method"] = "fallback (out of device memory while measuring the copies)"
            elif choice is None:
                fastest = {label: min(times) for label, times in seconds.items()}
                choice = pick(fastest, combos, margins)
                timings_ms = {label: round(t * 1e3, 3) for label, t in fastest.items()}
                record.update(
                    method="measured",
                    timings_ms=timings_ms,
                    timed_steps={label: len(times) for label, times in seconds.items()},
                    how=(
                        f"{warmup} warm-up + up to {timed} timed training steps per combination "
                        "(forward, loss, backward, optimizer step) on copies of the model and "
                        "optimizer with the run's first batch, rounds interleaved, fastest step kept; "
                        f"a combination over {DROP_FACTOR}x the best after one round is dropped, and "
                        f"the rounds end once one wins by {CLEAR_FACTOR}x (margins charged)"
                    ),
                    cache=str(path),
                )
                if write_cache:
                    measured_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
                    entry = {"choice": choice, "timings_ms": timings_ms, "measured_at": measured_at}
                    _write_cache(path, key, entry)
            record["input_shape"] = describe_shape(batch)
    for plugin in plugins:
        if plugin.name in choice:
            plugin.use_variant(choice[plugin.name])
    record["choice"] = choice
    record["device"] = device_label(state.device)
    record["cost_s"] = round(time.perf_counter() - started, 3)
    return record


def _valid_choice(choice: Any, margins: Mapping[str, Mapping[str, float]]) -> bool:
    return (
        isinstance(choice, dict)
        and set(choice) == set(margins)
        and all(choice[p] in margins[p] for p in margins)
    )


def describe(record: Mapping[str, Any]) -> str:
    """The one line a run prints about its auto choice."""
    choice = ", ".join(f"{p}={v}" for p, v in record["choice"].items())
    line = f"slipstream: auto: {choice} ({record['method']}"
    timings = record.get("timings_ms") or record.get("cached_timings_ms")
    if timings:
        ordered = sorted(timings.items(), key=lambda kv: kv[1])
        parts = ", ".join(f"{_short(label)} {ms:.1f} ms" for label, ms in ordered)
        line += f"; step {parts}"
    margins = record.get("margins") or {}
    if margins:
        line += "; " + ", ".join(f"{v} only if >{m:.0%} faster" for ms in margins.values() for v, m in ms.items())
    return line + f"; took {record['cost_s']:.2f} s, outside the run's clock)"


def _short(label: str) -> str:
    """``a=bf16,b=nhwc`` as ``bf16+nhwc`` (the choice before it names the plugins)."""
    return "+".join(part.partition("=")[2] for part in label.split(","))


def print_choice(record: Mapping[str, Any]) -> None:
    print(describe(record), file=sys.stderr)


def choose_run_variants(
    state: State,
    algorithms: Sequence[Any],
    services: Any,
    *,
    payload: Mapping[str, Any] | None,
    options: Any,
    verbose: bool,
) -> None:
    """Measured ``auto`` for a run: each algorithm that declares variants is told which
    to run before ``init``; a resumed run keeps the checkpoint's choice (``payload``),
    and every rank runs rank 0's. ``services``: the run's (its default steps and
    normalisation); ``options``: its TrainerOptions."""
    from slipstream.services.batches import batch_mover

    pinned = None
    if payload is not None:
        pinned = payload.get("variants")
        pinned = dict(pinned) if isinstance(pinned, dict) else {}
    record = choose_variants(
        state,
        algorithms,
        model_name=str((state.config.get("model") or {}).get("name", "model")),
        steps=services.defaults,
        prepare=services.normalize.prepare,
        move=batch_mover(state.device),
        pinned=pinned,
        measure_on=options.autotune,
        warmup=options.autotune_warmup,
        timed=options.autotune_steps,
        write_cache=state.rank == 0,
    )
    if record is None:
        return
    if state.world_size > 1:
        import torch.distributed as dist

        shared = [record]
        dist.broadcast_object_list(shared, src=0)
        record = shared[0]
        for algo in algorithms:
            if algo.name in record["choice"]:
                algo.use_variant(record["choice"][algo.name])
    state.summary["auto"] = record
    if verbose:
        print_choice(record)
