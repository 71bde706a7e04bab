"""fsdp: sharding matches one process, resumes bit-exactly from full and sharded
checkpoints, its latest.pt resumes in one process, and it composes with
grad_accumulation. The two-process part runs once per session under torchrun."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from slipstream_fsdp import (
    FSDP,
    FSDPConfig,
    auto_units,
    make_contiguous,
    named_units,
    size_units,
    to_index_layout,
    to_name_layout,
)

from helpers import tiny_model
from slipstream import CheckpointError, ConfigError, Trainer, load_checkpoint
from slipstream.data import build_datasets, build_loader
from slipstream.optim import build_optimizer
from slipstream.plugins.discovery import plugin_config

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")
HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Path:
    """The runs of fsdp_ranks.py on 2 gloo processes (about 20 s in all)."""
    out = tmp_path_factory.mktemp("fsdp")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         "--master_addr=127.0.0.1", f"--master_port={_free_port()}", str(HERE / "fsdp_ranks.py"), str(out)],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def one_process(
    tmp_path: Path, batches: int = 6, load: Path | None = None, algorithms=(), impl: str | None = None
) -> Trainer:
    """The fsdp runs' training in one process: the same global batches of 16."""
    train, _, classes = build_datasets("synthetic", image_size=16, train_size=64, val_size=16, num_classes=4)
    model = tiny_model("vit", num_classes=classes)
    optimizer = (
        torch.optim.AdamW(model.parameters(), lr=1e-3)
        if impl is None
        else build_optimizer(model, "sgd", 0.05, impl=impl)
    )
    trainer = Trainer(
        model=model,
        optimizer=optimizer,
        train_data=build_loader(train, batch_size=16, seed=0),
        max_duration=f"{batches}ba",
        algorithms=list(algorithms),
        run_dir=tmp_path / "one",
        eval_interval=None,
        checkpoint_interval=None,
        load_path=load,
        progress_bar=False,
        verbose=False,
        device="cpu",
    )
    trainer.fit()
    return trainer


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    diff = torch.cat([(a[k].float() - b[k].float()).flatten() for k in a]).norm()
    return float(diff / torch.cat([b[k].float().flatten() for k in b]).norm())


# -- two processes ---------------------------------------------------------------------------


def test_two_processes_match_one_process(ranks, tmp_path):
    reference = one_process(tmp_path).state.model.state_dict()
    sharded = weights(ranks / "full.weights.pt")
    assert relative_difference(sharded, reference) < 1e-4
    initial = tiny_model("vit").state_dict()
    assert relative_difference(sharded, initial) > 1e-3  # and it trained


def test_default_optimizer_fused_by_auto_trains_with_foreach_under_fsdp(ranks, tmp_path):
    # impl auto picks fused SGD, which FSDP2's DTensors cannot run; fsdp steps it with
    # foreach instead, and the result is one process's fused SGD's.
    reference = one_process(tmp_path, batches=3, impl="auto")
    assert reference.state.optimizer.param_groups[0]["fused"]
    sharded = weights(ranks / "default_optimizer.weights.pt")
    assert relative_difference(sharded, reference.state.model.state_dict()) < 1e-4
    assert relative_difference(sharded, tiny_model("vit").state_dict()) > 1e-3
    summary = json.loads((ranks / "default_optimizer" / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert "foreach" in summary["fsdp"]["optimizer_impl"]


def test_explicit_fused_optimizer_is_refused_before_anything_is_written(ranks):
    refused = json.loads((ranks / "refused.json").read_text())
    assert refused["error"] and "\n" not in refused["error"]
    assert "algorithms.fsdp" in refused["error"] and "optimizer.impl=fused" in refused["error"]
    assert refused["run_dir"] is False


def test_mfu_is_counted_under_fsdp_as_in_one_process(ranks, tmp_path):
    # FSDP2 refuses the deepcopy the FLOP count makes: the plugin hands over a meta copy.
    one_process(tmp_path)
    alone = json.loads((tmp_path / "one" / "summary.json").read_text())
    sharded = json.loads((ranks / "full" / "summary.json").read_text())
    assert sharded["flop_count_error"] is None
    assert sharded["train_flops_per_sample"] == alone["train_flops_per_sample"] != {}
    assert sharded["mfu"] is not None and sharded["mfu"] > 0


def test_resumes_mid_epoch_bit_exactly_from_full_and_sharded_checkpoints(ranks):
    for kind in ("full", "sharded"):
        straight, resumed = weights(ranks / f"{kind}.weights.pt"), weights(ranks / f"{kind}_resumed.weights.pt")
        assert all(torch.equal(straight[k], resumed[k]) for k in straight), kind
    # ZeRO-2 (the sharded runs) and ZeRO-3 compute the same thing.
    full, sharded = weights(ranks / "full.weights.pt"), weights(ranks / "sharded.weights.pt")
    assert all(torch.equal(full[k], sharded[k]) for k in full)


def test_sharded_checkpoint_is_a_dcp_folder_named_by_the_file(ranks):
    folder = ranks / "sharded" / "checkpoints"
    payload = load_checkpoint(folder / "latest.pt")
    assert payload["model"] is None and payload["optimizer"] is None
    assert payload["shards"] == "ep1-ba6.dcp"
    assert (folder / "ep1-ba6.dcp" / ".metadata").is_file()
    assert len(list((folder / "ep1-ba6.dcp").glob("*.distcp"))) == 2  # one file per rank


def test_full_latest_pt_loads_with_torch_and_resumes_in_one_process(ranks, tmp_path):
    path = ranks / "full" / "checkpoints" / "ep0-ba3.pt"
    payload = torch.load(path, weights_only=True)
    model = tiny_model("vit")
    model.load_state_dict(payload["model"])  # the plain model's own keys, full tensors
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.load_state_dict(payload["optimizer"])  # torch's own layout
    assert payload["world_size"] == 2
    resumed = one_process(tmp_path / "resumed", load=path).state.model.state_dict()
    reference = one_process(tmp_path / "reference").state.model.state_dict()
    assert relative_difference(resumed, reference) < 1e-4


def test_a_sharded_checkpoint_does_not_resume_without_fsdp(ranks, tmp_path):
    with pytest.raises(CheckpointError, match="is sharded"):
        one_process(tmp_path, load=ranks / "sharded" / "checkpoints" / "ep0-ba3.pt")


def test_grad_accumulation_and_clipping_on_sharded_gradients(ranks, tmp_path):
    # 4 batches of 16 in groups of 2 on 2 processes equal 2 steps of 32 in one process,
    # which needs the unsynced micro-batches' gradients to reach the step, and clipping
    # by the norm of all shards together (max_norm is small enough to clip every step).
    from slipstream_grad_accumulation import GradAccumulation, GradAccumulationConfig
    from slipstream_grad_clipping import GradClipping, GradClippingConfig

    reductions = json.loads((ranks / "reductions.json").read_text())
    assert reductions["full"] % 6 == 0 and reductions["full"] > 0  # one per unit and batch
    assert reductions["accumulated"] == reductions["full"] // 6 * 2  # 4 batches, 2 steps
    accumulated = weights(ranks / "accumulated.weights.pt")
    clip = GradClipping(GradClippingConfig(max_norm=0.05))
    reference = one_process(tmp_path, batches=4, algorithms=[GradAccumulation(GradAccumulationConfig(steps=2)), clip])
    assert relative_difference(accumulated, reference.state.model.state_dict()) < 1e-4
    records = [json.loads(line) for line in (ranks / "accumulated" / "metrics.jsonl").read_text().splitlines()]
    norms = [r["grad_norm"] for r in records if "grad_norm" in r]
    assert norms and all(n > 0.05 for n in norms)  # logged as numbers, and above max_norm


def test_ema_keeps_a_sharded_average_that_checkpoints_and_resumes_in_full(ranks, tmp_path):
    from slipstream_ema import EMA, EMAConfig

    def ema_weights(run: str) -> dict[str, torch.Tensor]:
        payload = load_checkpoint(ranks / run / "checkpoints" / "latest.pt")
        return payload["plugins"]["ema"]["state"]["weights"]

    straight, resumed = ema_weights("ema"), ema_weights("ema_resumed")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    ema = EMA(EMAConfig(decay=0.8))
    one_process(tmp_path, algorithms=[ema])
    reference = ema.ema_model.state_dict()
    assert relative_difference(straight, reference) < 1e-4  # full tensors, the model's names
    trained = weights(ranks / "ema.weights.pt")
    assert relative_difference(straight, trained) > 1e-5  # an average, not the weights


# -- one process --------------------------------------------------------------------------------


def test_one_process_is_refused_with_how_to_launch(tmp_path):
    with pytest.raises(ConfigError, match="--nproc-per-node"):
        one_process(tmp_path, batches=1, algorithms=[FSDP()])


def test_a_process_group_of_one_set_up_by_the_caller_is_accepted(tmp_path):
    # How one GPU tests fsdp over NCCL (tests/cuda); here over gloo. Sharded over one
    # rank, it trains to the weights of the run without it.
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        sharded = one_process(tmp_path / "fsdp", batches=2, algorithms=[FSDP()])
        model = sharded.state.unwrapped_model
        assert sharded.summary["fsdp"]["units"] > 1 and any(isinstance(p, DTensor) for p in model.parameters())
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    finally:
        dist.destroy_process_group()
    plain = one_process(tmp_path / "plain", batches=2).state.unwrapped_model.state_dict()
    assert all(torch.equal(full[k], plain[k]) for k in plain)


def test_units_auto_named_and_by_size():
    vit, resnet = tiny_model("vit"), tiny_model("resnet")
    assert auto_units(vit) == [f"blocks.{i}" for i in range(len(vit.blocks))]
    assert auto_units(resnet) == ["layer1", "layer2", "layer3", "layer4"]
    assert named_units(vit, ["Block"]) == auto_units(vit)
    assert named_units(resnet, ["layer1", "layer1.0"]) == ["layer1"]  # outermost only
    with pytest.raises(ValueError, match="classes with parameters"):
        named_units(vit, ["NoSuchBlock"])
    with pytest.raises(ValueError, match="found no blocks"):
        auto_units(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    # The size policy: each unit holds at least min_params not already in a unit below.
    biggest = max(sum(p.numel() for p in b.parameters()) for b in vit.blocks)
    units = size_units(vit, biggest)
    assert set(auto_units(vit)) <= set(units)
    assert size_units(vit, 10**9) == []  # only the root


def test_channels_last_weights_are_made_contiguous_in_place():
    model = tiny_model("resnet").to(memory_format=torch.channels_last)
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    assert make_contiguous(model) > 0  # FSDP2 refuses non-contiguous parameters
    assert all(p.is_contiguous() for p in model.parameters())
    for name, p in model.named_parameters():
        assert p is before[name][0] and torch.equal(p, before[name][1])  # same objects and values
    assert make_contiguous(model) == 0


def test_optimizer_layouts_round_trip():
    model = tiny_model("vit")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.rand(2, 3, 16, 16)).sum().backward()
    optimizer.step()
    names = [n for n, _ in model.named_parameters()]
    by_index = optimizer.state_dict()
    by_name = to_name_layout(by_index, names)
    assert set(by_name["state"]) == set(names)
    back = to_index_layout(by_name, names)
    assert back["param_groups"] == by_index["param_groups"]
    assert all(torch.equal(back["state"][i]["exp_avg"], by_index["state"][i]["exp_avg"]) for i in by_index["state"])


def test_config_errors_name_the_key_and_what_is_allowed():
    with pytest.raises(ConfigError, match="algorithms.fsdp: param_dtype must be one of fp32, bf16, fp16"):
        plugin_config(FSDP, {"param_dtype": "int8"})
    with pytest.raises(ConfigError, match="modules must be 'auto' or a non-empty list"):
        plugin_config(FSDP, {"modules": []})
    with pytest.raises(ConfigError, match="min_params must be a whole number >= 1"):
        plugin_config(FSDP, {"min_params": 0})
    assert plugin_config(FSDP, {}) == FSDPConfig()
