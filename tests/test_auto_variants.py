"""Measured auto (slipstream.plugins.variants): plugins declare variants, the engine times them
on copies at fit start, tells each plugin its variant before init, caches the choice,
pins it in checkpoints, and leaves the run exactly as it would be without measuring."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch
from slipstream_channels_last import ChannelsLast, ChannelsLastConfig
from slipstream_mixed_precision import MixedPrecision, MixedPrecisionConfig

from helpers import tiny_loaders, tiny_model
from slipstream import Algorithm, ConfigError, Trainer, Variant, hookimpl
from slipstream.plugins.variants import cache_path, pick

FAST = {"autotune_warmup": 1, "autotune_steps": 2}
# Every test here measures variants on purpose (tests/conftest.py refuses it elsewhere).
pytestmark = pytest.mark.autotune
# What the slow variant adds to each of its steps on the measurement's clock: far more
# than a step of this file's tiny model takes on any machine however loaded, so the
# outcome does not depend on the machine's speed (a real sleep of 50 ms lost to the
# fast variant's stalls under a loaded xdist run).
SLOW_STEP_S = 10.0


class _MeasuringClock:
    """The engine's measurement clock (``variants.time``): real time plus what the slow
    variants added."""

    added = 0.0

    def perf_counter(self) -> float:
        return time.perf_counter() + self.added


CLOCK = _MeasuringClock()


@pytest.fixture(autouse=True)
def _measuring_clock(monkeypatch):
    from slipstream.plugins import variants

    monkeypatch.setattr(variants, "time", CLOCK)


class Fused(Algorithm):
    """A third party's kernel switch; its ``slow`` variant does extra work in every forward."""

    name = "fused_kernel"

    def __init__(self, config=None, slow: str = "off") -> None:
        super().__init__(config)
        self.slow = slow
        self.seen_variant_at_init: str | None = None

    def variants(self, state):
        return [Variant("off"), Variant("on")]

    @hookimpl
    def init(self, state) -> None:
        self.seen_variant_at_init = self.variant

    @hookimpl(wrapper=True)
    def forward(self, state):
        if self.variant == self.slow:
            # Time on the measurement's clock, and draws from the run's random streams:
            # the measurement's steps must not move them.
            torch.rand(1)
            random.random()
            CLOCK.added += SLOW_STEP_S
        return (yield)


def _fit(tmp_path, name, algorithms, *, max_duration="4ba", **kwargs):
    train_data, eval_data = tiny_loaders()
    model = tiny_model()
    trainer = Trainer(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        train_data=train_data,
        eval_data=eval_data,
        max_duration=max_duration,
        algorithms=algorithms,
        run_dir=tmp_path / name,
        device="cpu",
        progress_bar=False,
        verbose=False,
        eval_interval=None,
        peak_tflops=1.0,  # no FLOP/s probe: the fixture's fresh cache would run one per test
        **{"checkpoint_interval": None, **FAST, **kwargs},
    )
    summary = trainer.fit()
    return trainer, summary


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_third_party_variant_is_measured_and_set_before_init(tmp_path, fresh_cache):
    plugin = Fused(slow="on")
    trainer, summary = _fit(tmp_path, "a", [plugin])
    auto = summary["auto"]
    assert auto["method"] == "measured"
    assert auto["choice"] == {"fused_kernel": "off"}  # the slow variant lost
    assert plugin.seen_variant_at_init == "off"
    assert set(auto["timings_ms"]) == {"fused_kernel=off", "fused_kernel=on"}
    assert auto["cost_s"] > 0
    on_disk = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert on_disk["auto"]["choice"] == {"fused_kernel": "off"}
    # The other way round, the other choice: the engine decides by time, not by order
    # (the cache, which keys the model and the variants' names, would give "off").
    cache_path().unlink()
    _, summary = _fit(tmp_path, "b", [Fused(slow="off")], max_duration="1ba")
    assert summary["auto"]["choice"] == {"fused_kernel": "on"}


def _auto_pair():
    return [Fused(slow="on"), ChannelsLast(ChannelsLastConfig(mode="auto"))]


def test_measuring_leaves_the_run_bit_exact_and_the_cache_is_reused(tmp_path, fresh_cache):
    # Run 1 measures (with more steps than the defaults of this file: the copies'
    # steps must leave no trace), run 2 takes the cached choice, run 3 sets the same
    # variants explicitly and measures nothing: the three trained models, optimizer
    # states and random streams after the run are identical. (fp32 only: bf16 autocast
    # on this project's CPU is not bit-reproducible between two identical runs.)
    first, s1 = _fit(tmp_path, "measured", _auto_pair(), autotune_steps=2)
    rng_first = torch.get_rng_state(), random.getstate()
    assert s1["auto"]["method"] == "measured"
    assert len(s1["auto"]["timings_ms"]) >= 2
    assert cache_path().is_file()
    second, s2 = _fit(tmp_path, "cached", _auto_pair())
    assert s2["auto"]["method"] == "cache"
    assert s2["auto"]["choice"] == s1["auto"]["choice"]
    choice = s1["auto"]["choice"]
    assert choice["fused_kernel"] == "off"
    forced = [ChannelsLast(ChannelsLastConfig(mode="always"))] if choice["channels_last"] == "nhwc" else []
    third, s3 = _fit(tmp_path, "forced", forced)
    assert "auto" not in s3  # explicit settings: nothing to measure
    assert torch.equal(rng_first[0], torch.get_rng_state()) and rng_first[1] == random.getstate()
    for other in (second, third):
        for a, b in zip(first.state.model.state_dict().values(), other.state.model.state_dict().values(), strict=True):
            assert torch.equal(a, b)
        sa, sb = first.state.optimizer.state_dict()["state"], other.state.optimizer.state_dict()["state"]
        assert all(torch.equal(sa[k]["momentum_buffer"], sb[k]["momentum_buffer"]) for k in sa)


def test_a_resumed_run_keeps_the_checkpoints_choice(tmp_path, fresh_cache):
    plugin = Fused(slow="on")
    _fit(tmp_path, "run", [plugin], max_duration="2ba", checkpoint_interval="1ba")
    assert plugin.variant == "off"
    # The same machine now finds "off" slow: a fresh run would switch, a resume must not.
    resumed = Fused(slow="off")
    _, summary = _fit(
        tmp_path, "run2", [resumed], max_duration="3ba", load_path=tmp_path / "run" / "checkpoints" / "latest.pt"
    )
    assert summary["auto"]["method"] == "checkpoint"
    assert resumed.variant == "off" and resumed.seen_variant_at_init == "off"


def test_explicit_settings_and_autotune_off_measure_nothing(tmp_path, fresh_cache):
    _, summary = _fit(
        tmp_path,
        "explicit",
        [MixedPrecision(MixedPrecisionConfig(dtype="bf16")), ChannelsLast(ChannelsLastConfig(mode="always"))],
        max_duration="1ba",
    )
    assert "auto" not in summary and summary["autocast_dtype"] == "bf16"
    plugin = Fused(slow="off")
    _, summary = _fit(tmp_path, "off", [plugin], max_duration="1ba", autotune=False)
    assert summary["auto"]["method"].startswith("fallback") and plugin.variant == "off"
    assert not cache_path().exists()


def test_reduced_precision_needs_a_clear_margin():
    combos = [{"mp": "bf16"}, {"mp": "fp32"}]
    margins = {"mp": {"bf16": 0.1, "fp32": 0.0}}
    assert pick({"mp=bf16": 0.95, "mp=fp32": 1.0}, combos, margins) == {"mp": "fp32"}
    assert pick({"mp=bf16": 0.85, "mp=fp32": 1.0}, combos, margins) == {"mp": "bf16"}
    # A combination dropped as too slow is no candidate.
    assert pick({"mp=fp32": 1.0}, combos, margins) == {"mp": "fp32"}


def test_mixed_precision_declares_only_where_the_device_has_a_reduced_precision(cpu_kind):
    state = type("S", (), {"device": torch.device("cpu")})()
    assert MixedPrecision(MixedPrecisionConfig(dtype="bf16")).variants(state) == []
    if cpu_kind in ("avx512_bf16", "amx"):
        assert [v.name for v in MixedPrecision().variants(state)] == ["bf16", "fp32"]
        assert MixedPrecision().variants(state)[0].margin == pytest.approx(0.1)
    else:
        assert MixedPrecision().variants(state) == []  # emulated bf16: fp32, unmeasured


def test_bad_autotune_settings_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="autotune_steps"):
        _fit(tmp_path, "bad", [], autotune_steps=0)
    with pytest.raises(ValueError, match="mode must be one of auto, always"):
        ChannelsLastConfig(mode="on")
