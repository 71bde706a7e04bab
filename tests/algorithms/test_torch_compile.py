"""torch_compile: the model is compiled at init, checkpoints stay plain, compile
time is reported apart, image-size curricula compile dynamic sizes once.

Most tests use the ``eager`` backend (Dynamo's capture and guards without code
generation, ~1 s) and a small CNN; one Inductor test is opt-in (see below).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from slipstream_channels_last import ChannelsLast, ChannelsLastConfig
from slipstream_torch_compile import (
    TorchCompile,
    TorchCompileConfig,
    check_backend,
    compile_model,
    mark_image_size_dynamic,
)
from torch import nn

from helpers import Probe, tiny_loaders
from slipstream import Algorithm, ConfigError, Trainer, hookimpl
from slipstream.plugins.discovery import discover, plugin_config

OptimizedModule = torch._dynamo.eval_frame.OptimizedModule


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Dynamo caches compiled code per function across model instances: without a
    # reset, a test would reuse the previous test's graphs and compile nothing.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )  # fmt: skip


def fit(tmp_path: Path, algorithms: list, *, model: nn.Module | None = None, evaluate=False,
        max_duration="3ba", **kwargs) -> Trainer:  # fmt: skip
    model = model or small_cnn()
    train_data, eval_data = tiny_loaders(n=32, batch_size=8)
    trainer = Trainer(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        train_data=train_data,
        eval_data=eval_data if evaluate else None,
        max_duration=max_duration,
        algorithms=algorithms,
        run_dir=kwargs.pop("run_dir", tmp_path / "run"),
        device="cpu",
        progress_bar=False,
        verbose=False,
        **kwargs,
    )
    trainer.fit()
    return trainer


def eager(**options) -> TorchCompile:
    return TorchCompile(TorchCompileConfig(backend="eager", **options))


class Record(Probe):
    def __init__(self) -> None:
        super().__init__(before_forward=self._seen)
        self.compiled: list[bool] = []
        self.sizes: list[int] = []

    def _seen(self, state) -> None:
        self.compiled.append(isinstance(state.model, OptimizedModule))
        self.sizes.append(state.batch[0].shape[-1])


def test_compiled_in_training_checkpoint_plain_compile_time_reported(tmp_path):
    record = Record()
    trainer = fit(tmp_path, [eager(), record], evaluate=True, max_duration="4ba")
    assert record.compiled == [True] * 4
    model = trainer.state.model
    assert isinstance(model, OptimizedModule) and trainer.state.unwrapped_model is model._orig_mod
    # The optimizer still updates the compiled model's parameters.
    assert trainer.state.optimizer.param_groups[0]["params"][0] is model._orig_mod[0].weight
    summary = trainer.summary
    assert summary["compile_time_s"] > 0
    assert summary["compile"]["compiles"] == 2  # the training graph and the no_grad eval graph
    assert summary["compile"]["compiling_steps"] == 1 and summary["compile"]["eval_s"] > 0
    assert summary["compile"]["graph_breaks"] == 0

    latest = trainer.run_dir / "checkpoints" / "latest.pt"
    keys = torch.load(latest, weights_only=True)["model"].keys()
    assert keys and not any("_orig_mod" in k for k in keys)
    plain = small_cnn()
    plain.load_state_dict(torch.load(latest, weights_only=True)["model"])  # plain keys load

    resumed = fit(
        tmp_path, [eager()], max_duration="6ba", run_dir=trainer.run_dir, load_path=latest
    )
    assert resumed.summary["batches"] == 6 and isinstance(resumed.state.model, OptimizedModule)


def test_not_compiled_when_off(tmp_path):
    record = Record()
    trainer = fit(tmp_path, [record], max_duration="1ba")
    assert record.compiled == [False] and "compile_time_s" not in trainer.summary


class Curriculum(Probe):
    """A third-party image-size curriculum: 16 px, then 24 px from batch 2. It says
    so through ``state.varying_input_size``; torch_compile does not know its name."""

    name = "my_curriculum"

    def __init__(self) -> None:
        super().__init__(batch_start=self._resize)

    @hookimpl
    def init(self, state) -> None:
        state.varying_input_size = True

    def _resize(self, state) -> None:
        if state.timestamp.batch >= 2:
            inputs, targets = state.batch
            state.batch = (F.interpolate(inputs, size=24, mode="bilinear"), targets)


@pytest.mark.parametrize("dynamic_image_size, compiles", [(None, 1), (False, 2)])
def test_curriculum_compiles_sizes_dynamically_once(tmp_path, dynamic_image_size, compiles):
    # None (auto): the curriculum is in the run, so height and width are dynamic from
    # the first step and the new size reuses the graph. False: torch compiles 16 px
    # statically, then recompiles when 24 px arrives.
    record = Record()
    algos = [eager(dynamic_image_size=dynamic_image_size), Curriculum(), record]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(tmp_path, algos, max_duration="4ba")
    recompile_warnings = [w for w in caught if "compiled again in batch 3 of the run" in str(w.message)]
    assert len(recompile_warnings) == compiles - 1  # says why and what to do, once
    # Registered after torch_compile, whose init runs first: the decision waits for fit_start.
    assert [a.name for a in trainer.algorithms][:2] == ["torch_compile", "my_curriculum"]
    assert record.sizes == [16, 16, 24, 24]
    assert trainer.summary["compile"]["compiles"] == compiles
    assert trainer.summary["compile"]["dynamic_image_size"] is (dynamic_image_size is None)


class _AutocastStub(Algorithm):
    """mixed_precision's forward wrapper, for when that plugin is not installed."""

    name = "mixed_precision"

    @hookimpl(wrapper=True)
    def forward(self, state) -> Iterator[None]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (yield)


def test_with_channels_last_and_mixed_precision(tmp_path):
    info = discover().get("mixed_precision")
    # Explicit bf16: auto trains in fp32 on a CPU without bf16 units.
    mixed = (
        info.cls(plugin_config(info.cls, {"dtype": "bf16"}))
        if info is not None and info.cls is not None
        else _AutocastStub()
    )
    dtypes: list[torch.dtype] = []
    weights_cl: list[bool] = []

    def seen(state) -> None:
        dtypes.append(state.outputs.dtype)
        conv = state.unwrapped_model[0].weight
        weights_cl.append(conv.is_contiguous(memory_format=torch.channels_last))

    # Listed first, torch_compile still runs after the others at init.
    always = ChannelsLast(ChannelsLastConfig(mode="always"))  # NHWC whatever auto would measure
    trainer = fit(tmp_path, [eager(), mixed, always, Probe(after_forward=seen)])
    order = [a.name for a in trainer.algorithms]
    assert order.index("torch_compile") > order.index("mixed_precision")
    assert order.index("torch_compile") > order.index("channels_last")
    assert isinstance(trainer.state.model, OptimizedModule)
    assert dtypes == [torch.bfloat16] * 3  # autocast reaches into the compiled forward
    assert all(weights_cl)


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"torch_compile: mode must be one of default, reduce-"):
        plugin_config(TorchCompile, {"mode": "fastest"})
    with pytest.raises(ConfigError, match="applies to the inductor backend only"):
        plugin_config(TorchCompile, {"mode": "max-autotune", "backend": "eager"})
    with pytest.raises(ConfigError, match="fullgraph"):
        plugin_config(TorchCompile, {"fullgraph": "perhaps"})
    assert plugin_config(TorchCompile, {"mode": "reduce-overhead"}).mode == "reduce-overhead"
    # Backends are checked at init (listing them imports Dynamo), before any compiling.
    typo = TorchCompile(TorchCompileConfig(backend="nductor"))
    with pytest.raises(ConfigError, match=r"unknown backend 'nductor'; available: .*inductor"):
        fit(tmp_path, [typo], max_duration="1ba")


def test_functional_api():
    model = small_cnn()
    compiled = compile_model(model, mode="default", backend="eager")
    assert isinstance(compiled, OptimizedModule) and compiled._orig_mod is model
    assert list(compiled.parameters()) == list(model.parameters())
    check_backend("aot_eager")  # debug backends are allowed
    with pytest.raises(ConfigError, match="unknown backend"):
        compile_model(model, backend="no-such-backend")
    with pytest.raises(ConfigError, match="mode must be one of"):
        compile_model(model, mode="turbo")
    x = torch.rand(2, 3, 8, 8)
    assert mark_image_size_dynamic(x) is x
    assert mark_image_size_dynamic(torch.rand(2, 5)).shape == (2, 5)  # not an image: untouched


# Inductor generates and builds C++ for the forward and backward graphs: 1-4 minutes
# for even this small CNN on the shared 2-core machine, so it is opt-in.
@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("SLIPSTREAM_SLOW_TESTS"),
    reason="Inductor compilation takes minutes here; set SLIPSTREAM_SLOW_TESTS=1 to run it",
)
def test_inductor_compiles_and_trains(tmp_path):
    record = Record()
    trainer = fit(tmp_path, [TorchCompile(), record], max_duration="3ba")
    assert record.compiled == [True] * 3
    assert trainer.summary["compile"]["compiles"] == 1
    assert trainer.summary["compile_time_s"] > 0


def test_a_run_mostly_spent_compiling_is_told_so(tmp_path, monkeypatch):
    import slipstream_torch_compile as plugin

    # A short eager-backend run: its compile takes a fraction of a second, under the
    # 1 s that calls for a word.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet = fit(tmp_path / "quiet", [eager()], max_duration="3ba")
    assert not [w for w in caught if "rarely wins that back" in str(w.message)]
    assert 0 < quiet.summary["compile"]["share_of_run"]
    # The same run had its compilation taken several seconds, most of the run (as on
    # an H100, 26 s of a 32 s run): the user hears that compiling did not pay.
    monkeypatch.setattr(plugin._StepClock, "compile_time", lambda self: 2.5)  # training and evaluation each
    monkeypatch.setattr(plugin.State, "session_elapsed_s", property(lambda self: 6.0))
    with pytest.warns(UserWarning, match=r"compiling took 5.0 s, 83 % of this run's 6.0 s"):
        loud = fit(tmp_path / "loud", [eager()], max_duration="3ba")
    assert loud.summary["compile"]["share_of_run"] == pytest.approx(5 / 6, abs=1e-3)
