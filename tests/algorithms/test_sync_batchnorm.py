"""sync_batchnorm: in one process a warning and nothing else; under DDP on GPUs the
batch-norm layers become SyncBatchNorm before the wrap (same parameters and keys; timm's
BatchNormAct2d keeps its activation); under DDP on CPUs (gloo), where torch's
SyncBatchNorm has no kernels, refused at init in one line before anything is written,
checked in a real 2-process gloo run; with ghost_batchnorm or fsdp refused by name."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from slipstream_sync_batchnorm import (
    SyncBatchNorm,
    batchnorm_layers,
    convert_sync_batchnorm,
    sync_decision,
    synced_layers,
)
from torch import nn

from helpers import error_lines, tiny_model
from helpers import train as _train
from slipstream import Algorithm, ConfigError
from slipstream.plugins.discovery import PluginInfo, discover, plugin_config, resolve_order
from slipstream.services.flops import training_flops_per_sample

HERE = Path(__file__).parent
INSTALLED = discover(load=False)
CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def _no_flop_count(monkeypatch):
    # Counting FLOPs for MFU (a meta copy, forward and backward) costs these tiny runs
    # 4x their training, and no test here reads MFU.
    monkeypatch.setattr("slipstream.services.utilization.training_flops_per_sample", lambda model, inputs: 0.0)


def train(tmp_path, algos, **kwargs):
    known = {a.name: PluginInfo(a.name, "tests", "0", "helpers", cls=type(a)) for a in algos}
    return _train(tmp_path, algos, installed={**INSTALLED, **known}, **kwargs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def forked_ranks(out: Path) -> None:
    """sync_batchnorm_ranks.forked_cpu_rank on 2 forked processes (a gloo group of 2)."""
    from sync_batchnorm_ranks import forked_cpu_rank

    for attempt in range(3):  # a free port may be taken again before rank 0 listens on it
        try:
            mp.start_processes(forked_cpu_rank, args=(str(out), _free_port()), nprocs=2, start_method="fork")
            return
        except mp.ProcessRaisedException as exc:
            if "EADDRINUSE" not in str(exc) and "address already in use" not in str(exc) or attempt == 2:
                raise


def torchrun_gpu_ranks(out: Path) -> None:
    """sync_batchnorm_ranks.py under torchrun: 2 fresh processes (CUDA cannot be forked)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
         f"--master_port={_free_port()}", str(HERE / "sync_batchnorm_ranks.py"), str(out)],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]


# -- one process --------------------------------------------------------------------------


def test_one_process_warns_and_changes_nothing(tmp_path):
    model = tiny_model()
    layers = dict(model.named_modules())
    with pytest.warns(UserWarning, match=r"sync_batchnorm: this run has one process, so there is no other batch"):
        run = train(tmp_path, [SyncBatchNorm()], model=model, max_duration="1ba", eval_interval=None,
                    checkpoint_interval=None)
    assert run.state.model is model and not synced_layers(model)
    assert all(layers[n] is m for n, m in model.named_modules())  # not one module replaced
    assert run.summary["sync_batchnorm"] == {"layers": 0, "synchronised": False,
                                             "reason": "not distributed: one process"}


# -- what the plugin decides, and the conversion (the GPU path's logic, on CPU) -----------


def test_the_decision_by_processes_and_device(monkeypatch):
    assert sync_decision(1, GPU) == sync_decision(1, CPU) == "warn"
    assert sync_decision(2, CPU) == "refuse"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sync_decision(2, GPU) == "refuse"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert sync_decision(8, GPU) == "convert"


def test_conversion_keeps_parameters_keys_and_timm_activations():
    model = tiny_model()
    params, keys = list(model.parameters()), list(model.state_dict())
    n = len(batchnorm_layers(model))
    converted, count = convert_sync_batchnorm(model)
    assert converted is model and count == n == len(synced_layers(model)) and not batchnorm_layers(model)
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))  # the optimizer needs nothing
    assert list(model.state_dict()) == keys  # checkpoints load into the plain model
    # timm's norm + activation layer keeps its activation (torch's converter drops it).
    norm_act = nn.Sequential(timm.layers.BatchNormAct2d(4, act_layer=nn.ReLU))
    convert_sync_batchnorm(norm_act)
    assert type(norm_act[0]).__name__ == "SyncBatchNormAct" and isinstance(norm_act[0].act, nn.ReLU)
    # A model that is one batch-norm layer comes back as a new module.
    alone, count = convert_sync_batchnorm(nn.BatchNorm1d(3))
    assert type(alone) is nn.SyncBatchNorm and count == 1

    class OwnForward(nn.BatchNorm2d):
        def forward(self, x):
            return super().forward(x) * 2

    with pytest.raises(ConfigError, match=r"cannot convert 1 \(OwnForward\): a batch-norm subclass with a forward"):
        convert_sync_batchnorm(nn.Sequential(nn.Identity(), OwnForward(3)))


def _state(model: nn.Module, world_size: int, device: torch.device) -> SimpleNamespace:
    return SimpleNamespace(model=model, unwrapped_model=model, world_size=world_size, device=device, summary={},
                           flops_model=None)


def test_under_ddp_on_gpus_the_layers_are_converted_before_the_wrap_and_mfu_still_counts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = tiny_model()
    state = _state(model, 2, GPU)
    plugin = SyncBatchNorm()
    plugin.init(state)  # init: before wrap_model, which wraps what init left
    assert state.model is model and synced_layers(model) and not batchnorm_layers(model)
    assert state.summary["sync_batchnorm"] == {"layers": len(synced_layers(model)), "synchronised": True,
                                               "world_size": 2}
    # The FLOP counter's meta copy: torch's SyncBatchNorm refuses a meta tensor in training
    # once a process group exists (here one of one process), the plugin's copy counts.
    plugin.fit_start(state)
    x = torch.rand(2, 3, 16, 16)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="SyncBatchNorm expected input tensor to be on GPU"):
            training_flops_per_sample(model, x)
        counted = training_flops_per_sample(state.flops_model, x)
    finally:
        dist.destroy_process_group()
    assert counted == training_flops_per_sample(tiny_model(), x) > 0
    alone = _state(nn.BatchNorm2d(3), 2, GPU)
    SyncBatchNorm().init(alone)
    assert type(alone.model) is nn.SyncBatchNorm


def test_under_ddp_a_model_without_batch_norm_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError) as info:
        SyncBatchNorm().init(_state(tiny_model("vit"), 2, GPU))
    assert str(info.value).startswith("sync_batchnorm cannot change VisionTransformer: it has no BatchNorm1d/2d/3d")


# -- two processes ------------------------------------------------------------------------


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")
def test_two_cpu_processes_are_refused_in_one_line_before_anything_is_written(tmp_path):
    forked_ranks(tmp_path)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["world_size"] == 2  # the engine joined the group of 2
        assert result["error"].startswith(
            "algorithms.sync_batchnorm: torch 2.") and "synchronises only on GPUs" in result["error"]
        assert "this run of 2 processes trains on cpu" in result["error"]
        assert len(error_lines(result["error"])) == 1 and result["run_dir"] is False
        # The reason, in torch's own words, in the same process group:
        assert result["torch"].startswith("SyncBatchNorm expected input tensor to be on GPU")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch.cuda.is_available() is False")
def test_two_gpu_processes_share_their_statistics(tmp_path):
    torchrun_gpu_ranks(tmp_path)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["synced"]["classes"] == ["SyncBatchNorm"] and r0["synced"]["synchronised"] is True
    assert "SyncBatchNorm" not in r0["plain"]["classes"]
    for key, mean in r0["synced"]["running_mean"].items():
        torch.testing.assert_close(mean, r1["synced"]["running_mean"][key], rtol=1e-5, atol=1e-6)
    # Each rank trained on its own shard: without the plugin the statistics differ.
    assert any(not torch.allclose(m, r1["plain"]["running_mean"][k]) for k, m in r0["plain"]["running_mean"].items())


# -- with other plugins ---------------------------------------------------------------------


def test_ghost_batchnorm_and_fsdp_are_refused_by_name_and_surgery_comes_first():
    def stand_in(name: str) -> Algorithm:
        return type(name, (Algorithm,), {"name": name})()

    for other, why in (("ghost_batchnorm", "ask for opposite statistics"), ("fsdp", "DistributedDataParallel only")):
        with pytest.raises(Exception, match=rf"'sync_batchnorm' conflicts with '{other}' \(.*{why}"):
            resolve_order([SyncBatchNorm(), stand_in(other)])
    later = ["stochastic_depth", "ema", "channels_last", "activation_checkpointing", "torch_compile"]
    order = [a.name for a in resolve_order([*map(stand_in, later), SyncBatchNorm()])]
    assert order[0] == "sync_batchnorm"


def test_it_takes_no_options():
    with pytest.raises(ConfigError, match=r"algorithms.sync_batchnorm") as info:
        plugin_config(SyncBatchNorm, {"group_size": 2})
    assert len(error_lines(str(info.value))) == 1
