"""MFU, FLOP counting, the peak FLOP/s probe and its cache, peak memory."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

from helpers import Probe, tiny_loaders, train
from slipstream import ConfigError, Trainer
from slipstream.services import Utilization
from slipstream.services import peak_flops as pf
from slipstream.services.flops import training_flops_per_sample


def conv_net() -> nn.Module:
    # conv 3->8 (3x3, same padding) -> ReLU -> global pool -> linear 8->4
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def analytic_train_flops(height: int, width: int) -> int:
    """Per sample. A matmul of m x k by k x n is 2mkn FLOPs. Forward: the conv is
    2 * (3*3*3) * 8 per output pixel, the linear 2 * 8 * 4. Backward: each layer's
    weight gradient costs its forward again, and the linear's input gradient once
    more; the conv needs no input gradient (the inputs do not require one)."""
    conv = 2 * 27 * 8 * height * width
    linear = 2 * 8 * 4
    return 2 * conv + 3 * linear


# --------------------------------------------------------------------------- FLOPs


def test_flops_per_sample_equal_the_analytic_count() -> None:
    model = conv_net()
    assert training_flops_per_sample(model, torch.rand(5, 3, 16, 16)) == analytic_train_flops(16, 16)
    assert training_flops_per_sample(model, torch.rand(2, 3, 8, 12)) == analytic_train_flops(8, 12)


def test_counting_touches_nothing_of_the_model() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5), nn.Flatten())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = torch.rand(4, 3, 8, 8)
    rng = torch.get_rng_state()
    training_flops_per_sample(model, inputs)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BN stats and counter too
    assert all(p.grad is None and p.device.type == "cpu" for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


class Upsample2x:
    """A hook object that is part of the computation: the model sees twice the size."""

    def __call__(self, module, args):
        return (F.interpolate(args[0], scale_factor=2.0),)


def test_hook_objects_are_counted_and_hook_functions_left_alone() -> None:
    model = conv_net()
    calls: list[torch.dtype] = []
    model[0].register_forward_hook(lambda m, i, out: calls.append(out.dtype))  # a monitor
    model[0].register_forward_pre_hook(Upsample2x())
    assert training_flops_per_sample(model, torch.rand(2, 3, 8, 8)) == analytic_train_flops(16, 16)
    assert calls == []  # the monitor never saw the counting pass
    model(torch.rand(2, 3, 8, 8))
    assert calls == [torch.float32]  # and still sees the real one


class HalfSizeFirstEpoch(Probe):
    """Feeds 8 px images in the first epoch, 16 px after (a curriculum's effect)."""

    def __init__(self) -> None:
        super().__init__(batch_start=self._resize)

    @staticmethod
    def _resize(state) -> None:
        if state.timestamp.epoch == 0:
            inputs, targets = state.batch
            state.batch = (F.interpolate(inputs, size=(8, 8), mode="bilinear"), targets)


def test_a_run_counts_each_input_size_once_and_reports_mfu(tmp_path: Path) -> None:
    trainer = train(
        tmp_path, [HalfSizeFirstEpoch()], model=conv_net(), peak_tflops=0.5, log_interval=2
    )
    summary = trainer.summary
    assert summary["train_flops_per_sample"] == {
        "3x8x8": analytic_train_flops(8, 8),
        "3x16x16": analytic_train_flops(16, 16),
    }
    assert summary["peak_source"] == "config" and summary["peak_tflops"]["fp32"] == 0.5
    assert 0 < summary["mfu"] < 1
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    train_records = [r for r in records if r["kind"] == "train"]
    assert len(train_records) == 4
    for record in train_records:
        # Each interval's MFU is its FLOPs per second over the peak: samples/s times
        # the FLOPs per sample of the size it trained at.
        per_sample = analytic_train_flops(*record["image_size"])
        expected = record["samples_per_s"] * per_sample / 0.5e12
        assert 0 < record["mfu"] < 1
        assert record["mfu"] == pytest.approx(expected, rel=1e-6)


def test_mfu_is_against_the_peak_of_the_compute_dtype(tmp_path: Path) -> None:
    # Any precision plugin sets state.compute_dtype; the engine names none of them.
    bf16 = Probe(init=lambda state: setattr(state, "compute_dtype", torch.bfloat16))
    peaks = {"fp32": 1.0, "bf16": 4.0}
    fp32_run = train(tmp_path / "a", model=conv_net(), peak_tflops=peaks).summary
    bf16_run = train(tmp_path / "b", [bf16], model=conv_net(), peak_tflops=peaks).summary
    assert fp32_run["compute_dtype"] == "fp32" and bf16_run["compute_dtype"] == "bf16"
    assert fp32_run["peak_dtype"] == "fp32" and bf16_run["peak_dtype"] == "bf16"
    per_sample = analytic_train_flops(16, 16)
    for summary, peak in ((fp32_run, 1.0), (bf16_run, 4.0)):
        assert summary["mfu"] == pytest.approx(summary["samples_per_s"] * per_sample / (peak * 1e12))
    with pytest.raises(ConfigError, match="no value for bf16"):
        train(tmp_path / "c", [bf16], model=conv_net(), peak_tflops={"fp32": 1.0})


def test_the_counter_does_not_change_training(tmp_path: Path) -> None:
    # Batch norm, dropout (random numbers) and momentum: anything the counter touched
    # would show in the weights or buffers.
    def run(where: str, counter: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = timm.create_model("test_resnet", num_classes=4, drop_rate=0.3)
        train_data, eval_data = tiny_loaders()
        trainer = Trainer(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            train_data=train_data,
            eval_data=eval_data,
            max_duration="2ep",
            run_dir=tmp_path / where,
            device="cpu",
            progress_bar=False,
            verbose=False,
            peak_tflops=1.0,
        )
        if not counter:
            trainer.pm.unregister(name=Utilization.name)
        trainer.fit()
        assert bool(trainer.summary["train_flops_per_sample"]) is counter
        return {k: v.clone() for k, v in model.state_dict().items()}

    with_counter, without = run("with", True), run("without", False)
    assert with_counter.keys() == without.keys()
    for key in with_counter:
        assert torch.equal(with_counter[key], without[key]), key


def test_a_model_that_cannot_be_counted_still_trains(tmp_path: Path) -> None:
    class ReadsValues(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3 * 16 * 16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum().item() > -1:  # data-dependent: meta tensors have no values
                return self.fc(x.flatten(1))
            return self.fc(x.flatten(1))

    with pytest.warns(UserWarning, match="cannot count this model's FLOPs"):
        trainer = train(tmp_path, model=ReadsValues(), peak_tflops=1.0)
    assert trainer.summary["status"] == "completed"
    assert trainer.summary["mfu"] is None and trainer.summary["flop_count_error"]


def test_inputs_that_are_not_a_tensor_leave_mfu_unknown(tmp_path: Path) -> None:
    # The per-batch tally compares each batch's shape with the last one's: inputs
    # without a shape must reach the counter (which gives up), not pass as "the same".
    class TakesAPair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3 * 16 * 16, 4)

        def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return self.fc(pair[0].flatten(1))

    x, y = next(iter(tiny_loaders()[0]))
    batches = [((x, x), y)] * 4
    model = TakesAPair()
    trainer = Trainer(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        train_data=batches,
        max_duration="1ep",
        run_dir=tmp_path / "run",
        device="cpu",
        eval_interval=None,
        progress_bar=False,
        verbose=False,
        peak_tflops=1.0,
    )
    with pytest.warns(UserWarning, match="cannot count this model.s FLOPs.*TypeError: the inputs are a tuple"):
        summary = trainer.fit()
    assert summary["status"] == "completed" and summary["mfu"] is None


# --------------------------------------------------------------------------- peak FLOP/s


@pytest.fixture
def counted_probe(monkeypatch):
    calls: list[str] = []

    def fake(device, dtype, seconds=pf.PROBE_SECONDS):
        calls.append(pf.dtype_name(dtype))
        return 1e11 if dtype == torch.float32 else 3e11

    monkeypatch.setattr(pf, "measure_matmul_flops", fake)
    return calls


def test_the_probe_is_cached_per_machine_and_reused(tmp_path: Path, counted_probe) -> None:
    cpu, path = torch.device("cpu"), tmp_path / "cache" / "peak_flops.json"
    first = pf.peak_flops(cpu, threads=2, path=path)
    assert first.source == "probe" and counted_probe == ["fp32", "bf16"]
    cached = json.loads(path.read_text())
    key = pf.machine_key(cpu, threads=2)
    assert "threads=2" in key and torch.__version__ in key
    assert cached[key]["flops"] == {"fp32": 1e11, "bf16": 3e11}

    again = pf.peak_flops(cpu, threads=2, path=path)
    assert again.source == "cache" and again.flops == first.flops
    assert counted_probe == ["fp32", "bf16"]  # not probed again

    pf.peak_flops(cpu, threads=1, path=path)  # another thread count is another peak
    assert counted_probe == ["fp32", "bf16"] * 2
    assert len(json.loads(path.read_text())) == 2

    path.write_text("{not json")  # a corrupt cache is probed again and rewritten
    assert pf.peak_flops(cpu, threads=2, path=path).source == "probe"
    assert json.loads(path.read_text())[key]["flops"]["fp32"] == 1e11


def test_no_dtype_peaks_below_fp32(tmp_path: Path, monkeypatch) -> None:
    # A CPU without native bf16 probes bf16 matmuls slowly, yet its bf16 convolutions
    # run at the fp32 rate: a slow probe is no peak (MFU would pass 1).
    rates = {torch.float32: 5e10, torch.bfloat16: 5e8}
    monkeypatch.setattr(pf, "measure_matmul_flops", lambda device, dtype, seconds=0: rates[dtype])
    path = tmp_path / "peak.json"
    for source in ("probe", "cache"):
        peak = pf.peak_flops(torch.device("cpu"), threads=1, path=path)
        assert peak.source == source and peak.flops == {"fp32": 5e10, "bf16": 5e10}
    (entry,) = json.loads(path.read_text()).values()
    assert entry["flops"]["bf16"] == 5e8  # the cache keeps what was measured


def test_a_run_writes_the_cache_in_xdg_cache_home(tmp_path, monkeypatch, counted_probe) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    first = train(tmp_path / "a", model=conv_net()).summary
    second = train(tmp_path / "b", model=conv_net()).summary
    assert (first["peak_source"], second["peak_source"]) == ("probe", "cache")
    assert first["peak_tflops"] == second["peak_tflops"] == {"fp32": 0.1, "bf16": 0.3}
    assert (tmp_path / "xdg" / "slipstream" / "peak_flops.json").is_file()
    assert len(counted_probe) == 2


def test_a_peak_cached_on_a_busy_machine_is_raised_by_the_run_that_beats_it(
    tmp_path, monkeypatch, counted_probe
) -> None:
    # A probe cached while the machine was busy (here: 1 kFLOP/s) would make every later
    # run report an MFU far above 1. The first run that beats it probes again and
    # raises the cache, so its own summary and every later run are right.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cpu = torch.device("cpu")
    path = pf.cache_path()
    key = pf.machine_key(cpu, threads=torch.get_num_threads())
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({key: {"flops": {"fp32": 1e3, "bf16": 1e3}}}))
    with pytest.warns(UserWarning, match="measured on a busy machine"):
        summary = train(tmp_path / "a", model=conv_net()).summary
    assert summary["peak_source"] == "cache, raised"
    assert 0 < summary["mfu"] <= 1
    assert counted_probe == ["fp32", "bf16"]
    assert json.loads(path.read_text())[key]["flops"]["fp32"] == 1e11
    again = train(tmp_path / "b", model=conv_net()).summary  # no warning, no probe
    assert again["peak_source"] == "cache" and counted_probe == ["fp32", "bf16"]


def test_a_runs_own_rate_never_becomes_the_cached_peak(tmp_path, monkeypatch) -> None:
    # A run of a few batches can time itself at an absurd rate; caching that as the
    # device's peak would make every later run's MFU tiny. Only probes enter the cache.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(pf, "measure_matmul_flops", lambda device, dtype, **_: 1e3)
    cpu = torch.device("cpu")
    key = pf.machine_key(cpu, threads=torch.get_num_threads())
    with pytest.warns(UserWarning, match="measured on a busy machine"):
        summary = train(tmp_path / "a", model=conv_net()).summary
    assert summary["mfu"] > 1  # still busy: the probe cannot explain the run, and says so
    assert json.loads(pf.cache_path().read_text())[key]["flops"]["fp32"] == 1e3


def test_the_real_probe_measures_a_plausible_rate() -> None:
    started = torch.get_rng_state()
    rate = pf.measure_matmul_flops(torch.device("cpu"), torch.float32, seconds=0.05)
    assert 1e8 < rate < 1e14  # 0.1 GFLOP/s to 100 TFLOP/s: any CPU
    assert torch.equal(torch.get_rng_state(), started)  # the run's random stream untouched


@pytest.fixture
def tf32_flags():
    """torch's TF32 switches, put back after the test."""
    kept = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = kept


def test_fp32_on_cuda_is_measured_against_tf32_where_tensor_cores_run_it(tf32_flags) -> None:
    # Decided from torch's flags and the model alone, so it is checked here without a GPU.
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    resnet = conv_net()
    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, num_classes=10)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
    assert pf.peak_name(torch.float32, cuda, resnet) == "tf32"  # cuDNN's default: convolutions on TF32
    assert pf.peak_name(None, cuda, resnet) == "tf32"
    assert pf.peak_name(torch.float32, cuda, vit) == "fp32"  # its matmuls stay fp32; a conv stem is not the bulk
    assert pf.peak_name(torch.bfloat16, cuda, resnet) == "bf16"
    assert pf.peak_name(torch.float32, cpu, resnet) == "fp32"
    lazy = nn.Sequential(nn.LazyConv2d(64, 3), nn.Flatten(), nn.Linear(8, 2))  # unbuilt: no weights yet
    assert pf.peak_name(torch.float32, cuda, lazy) == "fp32"
    torch.backends.cudnn.allow_tf32 = False
    assert pf.peak_name(torch.float32, cuda, resnet) == "fp32"
    torch.backends.cuda.matmul.allow_tf32 = True  # torch.set_float32_matmul_precision("high")
    assert pf.peak_name(torch.float32, cuda, vit) == "tf32"
    assert pf.peak_name(torch.float32, cpu, vit) == "fp32"


def test_the_probe_sets_tf32_for_the_tf32_peak_only_and_puts_the_flag_back(tf32_flags, monkeypatch) -> None:
    seen = {}
    monkeypatch.setattr(
        pf, "measure_matmul_flops", lambda device, dtype, **_: seen.setdefault(dtype, []).append(
            torch.backends.cuda.matmul.allow_tf32) or 1.0
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    for name in ("fp32", "tf32", "bf16"):
        pf._probe(torch.device("cuda"), name)
    assert seen == {torch.float32: [False, True], torch.bfloat16: [False]}
    assert torch.backends.cuda.matmul.allow_tf32 is False


@pytest.mark.parametrize(
    "value, message",
    [
        (-1, "positive number"),
        ("fast", "positive number"),
        (True, "positive number"),
        ({}, "is empty"),
        ({"fp8": 1.0}, "unknown dtype 'fp8'"),
        ({"bf16": 0}, "peak_tflops.bf16 must be a positive"),
    ],
)
def test_bad_peak_tflops_is_a_clear_error(tmp_path, value, message) -> None:
    with pytest.raises(ConfigError, match=message):
        train(tmp_path, model=conv_net(), peak_tflops=value)


def test_peak_tflops_per_dtype_parses() -> None:
    assert pf.parse_peak_tflops({"fp32": 0.2, "bf16": 1}) == {"fp32": 0.2e12, "bf16": 1e12}
    assert pf.parse_peak_tflops({"tf32": 400}) == {"tf32": 400e12}
    assert pf.parse_peak_tflops(2) == {"*": 2e12}
    assert pf.parse_peak_tflops(None) is None


# --------------------------------------------------------------------------- memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the per-run reset needs Linux")
def test_peak_memory_is_each_runs_own(tmp_path: Path) -> None:
    held: list[torch.Tensor] = []

    def allocate(state) -> None:
        if not held:
            held.append(torch.ones(32 * 2**20 // 4 * 4))  # 128 MiB, every page touched

    big = train(tmp_path / "big", [Probe(batch_end=allocate)], model=conv_net(), peak_tflops=1.0)
    held.clear()
    small = train(tmp_path / "small", model=conv_net(), peak_tflops=1.0)
    assert big.summary["peak_memory_mb"] >= 120
    # Measured from its own start: the earlier run's peak in this process does not count.
    assert small.summary["peak_memory_mb"] < 60


def test_probing_is_announced_only_when_the_device_is_probed(tmp_path):
    from slipstream.services.peak_flops import machine_key, peak_flops, probe_dtypes

    device, path = torch.device("cpu"), tmp_path / "peak.json"

    class Probing(Exception):
        pass

    def announce():
        raise Probing  # stands for the message, and spares the test the probe itself

    with pytest.raises(Probing):
        peak_flops(device, threads=1, path=path, on_probe=announce)
    flops = {name: 1e12 for name in probe_dtypes(device)}
    path.write_text(json.dumps({machine_key(device, 1): {"flops": flops}}))
    assert peak_flops(device, threads=1, path=path, on_probe=announce).source == "cache"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the per-run reset needs Linux")
def test_earlier_garbage_freed_during_a_run_does_not_hide_its_growth(tmp_path: Path) -> None:
    class Cycle:  # garbage only the cyclic collector frees, holding 128 MiB
        def __init__(self) -> None:
            self.me, self.data = self, torch.ones(32 * 2**20)

    earlier = Cycle()
    gc.collect()  # survived a full collection: in the oldest generation, as a past run's objects are
    del earlier
    held: list[torch.Tensor] = []

    def collect_then_allocate(state) -> None:
        if not held:
            gc.collect()  # were the earlier cycle freed here, the run's growth would read ~0
            held.append(torch.ones(24 * 2**20))  # 96 MiB, every page touched

    run = train(tmp_path, [Probe(batch_end=collect_then_allocate)], model=conv_net(), peak_tflops=1.0)
    assert run.summary["peak_memory_mb"] >= 90
    assert gc.get_freeze_count() == 0  # what the run held back is collectable again
