"""mixed_precision: autocast around forward and loss, GradScaler for fp16."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from itertools import pairwise

import pytest
import torch
from slipstream_mixed_precision import (
    MixedPrecision,
    MixedPrecisionConfig,
    autocast,
    resolve_dtype,
)

from helpers import Probe, tiny_loaders, tiny_model, train
from slipstream import ConfigError, Trainer
from slipstream.plugins.discovery import plugin_config


def small_model() -> torch.nn.Module:
    """Much faster than timm's test_resnet under fp16 autocast, which this CPU emulates."""
    torch.manual_seed(0)
    return torch.nn.Sequential(OrderedDict(
        conv=torch.nn.Conv2d(3, 8, 3, stride=2, padding=1),
        bn=torch.nn.BatchNorm2d(8),
        act=torch.nn.ReLU(),
        pool=torch.nn.AdaptiveAvgPool2d(2),  # keeps the quadrants the toy task is about
        flat=torch.nn.Flatten(),
        fc=torch.nn.Linear(32, 4),
    ))


def fp16(**kwargs) -> MixedPrecision:
    return MixedPrecision(MixedPrecisionConfig(dtype="fp16", **kwargs))


def bf16() -> MixedPrecision:
    # Explicit: "auto" picks fp32 on a CPU without bf16 units, and these tests are
    # about what autocast does (which works, slowly, on any CPU).
    return MixedPrecision(MixedPrecisionConfig(dtype="bf16"))


@pytest.fixture(autouse=True)
def _quiet_cpu_fp16_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="mixed_precision: fp16 on CPU")
        warnings.filterwarnings("ignore", message="mixed_precision: dtype bf16 on a CPU without")
        yield


def dtype_probe():
    """A Probe recording outputs, conv activation and loss dtypes, train and eval."""
    seen: dict[str, set] = {"outputs": set(), "conv": set(), "loss": set(), "eval": set()}

    def add_conv_hook(state):
        conv = next(m for m in state.model.modules() if isinstance(m, torch.nn.Conv2d))
        conv.register_forward_hook(lambda m, i, out: seen["conv"].add(out.dtype))

    probe = Probe(
        init=add_conv_hook,
        after_forward=lambda s: seen["outputs"].add(s.outputs.dtype),
        after_loss=lambda s: seen["loss"].add(s.loss.dtype),
        eval_batch_end=lambda s: seen["eval"].add(s.outputs.dtype),
    )
    return probe, seen


def test_autocast_bf16_inside_forward_and_eval_fp32_loss(tmp_path):
    probe, seen = dtype_probe()
    trainer = train(tmp_path, [bf16(), probe], max_duration="2ba")
    assert seen["outputs"] == {torch.bfloat16}
    assert seen["conv"] == {torch.bfloat16}
    assert seen["loss"] == {torch.float32}  # backward gets an fp32 loss
    assert seen["eval"] == {torch.bfloat16}  # evaluation runs under autocast too
    assert trainer.state.compute_dtype == torch.bfloat16
    assert trainer.summary["autocast_dtype"] == "bf16"
    # Weights stay fp32 (autocast casts copies).
    assert all(p.dtype == torch.float32 for p in trainer.state.model.parameters())


def test_full_precision_without_plugin(tmp_path):
    probe, seen = dtype_probe()
    trainer = train(tmp_path, [probe], max_duration="2ba")
    assert seen["outputs"] == seen["conv"] == seen["loss"] == seen["eval"] == {torch.float32}
    assert trainer.state.compute_dtype is None


def _epoch_losses(algos, tmp_path, epochs=4):
    losses: list[float] = []
    probe = Probe(after_loss=lambda s: losses.append(s.loss.item()))
    train(tmp_path, [*algos, probe], model=small_model(), max_duration=f"{epochs}ep",
          eval_interval=None)
    per_epoch = len(losses) // epochs
    return [sum(losses[i : i + per_epoch]) / per_epoch for i in range(0, len(losses), per_epoch)]


def _tracks_fp32(losses: list[float], fp32: list[float]) -> None:
    # Both must learn, and the reduced-precision run must follow fp32's curve: a
    # broken autocast or scaler (wrong dtype in the loss, skipped or unscaled steps)
    # either stalls or drifts away from it.
    assert fp32[-1] < 0.8 * fp32[0], fp32
    assert losses[-1] < 0.8 * losses[0], losses
    for low, full in zip(losses, fp32, strict=True):
        assert abs(low - full) <= 0.05 * fp32[0], (losses, fp32)


def test_bf16_training_tracks_fp32(tmp_path):
    fp32 = _epoch_losses([], tmp_path / "fp32")
    low = _epoch_losses([bf16()], tmp_path / "bf16")
    assert low != fp32  # autocast did change the arithmetic
    _tracks_fp32(low, fp32)


def test_config_errors():
    with pytest.raises(ConfigError) as err:
        plugin_config(MixedPrecision, {"dtype": "fp8"})
    msg = str(err.value)
    assert "dtype" in msg and "fp8" in msg
    assert all(choice in msg for choice in ("auto", "bf16", "fp16"))
    with pytest.raises(ConfigError, match="unknown key"):
        plugin_config(MixedPrecision, {"precision": "bf16"})
    assert plugin_config(MixedPrecision, {}).dtype == "auto"


def test_resolve_dtype_and_autocast_function(cpu_kind):
    native = cpu_kind in ("avx512_bf16", "amx")
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)  # fp32: no autocast
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("fp16", "cpu") == torch.float16
    with pytest.raises(ValueError, match="dtype must be one of auto, bf16, fp16"):
        resolve_dtype("fp32", "cpu")
    lin = torch.nn.Linear(4, 2)
    with autocast("cpu", torch.bfloat16):
        assert lin(torch.randn(3, 4)).dtype == torch.bfloat16
    assert lin(torch.randn(3, 4)).dtype == torch.float32


def test_bf16_state_saved_and_restored(tmp_path):
    first = train(tmp_path / "a", [bf16()], model=small_model(), max_duration="1ep",
                  eval_interval=None)
    ckpt = first.run_dir / "checkpoints" / "latest.pt"
    saved = torch.load(ckpt, weights_only=True)["plugins"]["mixed_precision"]
    assert saved["state"] == {"dtype": "bf16", "skipped_steps": 0}
    assert saved["config"] == {"dtype": "bf16", "warn_after_skips": 25}
    resumed = train(tmp_path / "a", [bf16()], model=small_model(), max_duration="2ep",
                    load_path=ckpt, eval_interval=None)
    assert resumed.state.timestamp.epoch == 2
    assert resumed.summary["autocast_dtype"] == "bf16"


# -- fp16 with a GradScaler: torch.amp.GradScaler("cpu") works, so the scaler path is
# tested on CPU with fp16 autocast on CPU (slow on this CPU, fine for a tiny model).


class AfterMixedPrecision(Probe):
    runs_after = ("mixed_precision",)


OVERFLOW_AT = {1, 4}  # batches whose gradients we make overflow, as fp16 would


def overflow(state) -> None:
    if state.timestamp.batch in OVERFLOW_AT:
        state.model.fc.weight.grad[0, 0] = float("inf")


def test_fp16_scaler_unscales_before_later_plugins_and_counts_skips(tmp_path):
    mp = fp16()
    record: list[dict] = []
    cur: dict = {}

    def grad_norm(state):
        grads = [p.grad for p in state.model.parameters() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads).item()

    def after_backward(state):
        cur.update(scaled=grad_norm(state), scale=mp.scaler.get_scale())
        overflow(state)

    probe = AfterMixedPrecision(
        after_forward=lambda s: cur.update(dtype=s.outputs.dtype),
        after_backward=after_backward,
        before_optimizer_step=lambda s: cur.update(
            seen=grad_norm(s), w=s.model.fc.weight.detach().clone()
        ),
        after_optimizer_step=lambda s: record.append(
            {**cur, "skipped": s.step_skipped, "new_scale": mp.scaler.get_scale(),
             "changed": not torch.equal(cur["w"], s.model.fc.weight)}
        ),
    )
    trainer = train(tmp_path, [probe, mp], model=small_model(), max_duration="2ep",
                    eval_interval=None, checkpoint_interval=None)
    assert [a.name for a in trainer.algorithms] == ["mixed_precision", "probe"]
    assert trainer.state.compute_dtype == torch.float16
    assert all(r["dtype"] == torch.float16 for r in record)
    assert [i for i, r in enumerate(record) if r["skipped"]] == sorted(OVERFLOW_AT)
    for r in record:
        # A skipped step halves the scale and leaves the weights alone.
        assert r["new_scale"] == (r["scale"] / 2 if r["skipped"] else r["scale"])
        assert r["changed"] == (not r["skipped"])
        if not r["skipped"]:
            # Later plugins see unscaled (true) gradients.
            assert r["seen"] == pytest.approx(r["scaled"] / r["scale"], rel=1e-3)
            assert r["scaled"] > 100 * r["seen"]
    assert trainer.summary["skipped_steps"] == len(OVERFLOW_AT)
    assert trainer.state.metrics["skipped_steps"] == len(OVERFLOW_AT)
    assert trainer.summary["loss_scale"] == 2.0**16 / 2 ** len(OVERFLOW_AT)


def test_fp16_fused_optimizer_detects_skips(tmp_path):
    model = small_model()
    train_data, _ = tiny_loaders()
    skipped: list[bool] = []
    mp = fp16()
    scales: list[float] = []
    probe = Probe(
        after_backward=overflow,
        before_optimizer_step=lambda s: scales.append(mp.scaler.get_scale()),
        after_optimizer_step=lambda s: skipped.append(s.step_skipped),
    )
    trainer = Trainer(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3, fused=True),
        train_data=train_data, max_duration="2ep", algorithms=[mp, probe],
        run_dir=tmp_path / "run", device="cpu", progress_bar=False, verbose=False,
        eval_interval=None, checkpoint_interval=None,
    )
    trainer.fit()
    scales.append(mp.scaler.get_scale())
    assert skipped == [after < before for before, after in pairwise(scales)]
    assert [i for i, sk in enumerate(skipped) if sk] == sorted(OVERFLOW_AT)
    assert trainer.summary["skipped_steps"] == sum(skipped)


def test_fp16_scaler_state_saved_and_restored(tmp_path):
    first = train(tmp_path / "a", [fp16(), Probe(after_backward=overflow)], model=small_model(),
                  max_duration="1ep", eval_interval=None)  # overflows at batch 1 of 0..3
    ckpt = first.run_dir / "checkpoints" / "latest.pt"
    state = torch.load(ckpt, weights_only=True)["plugins"]["mixed_precision"]["state"]
    assert state["dtype"] == "fp16"
    assert state["skipped_steps"] == first.summary["skipped_steps"] == 1
    assert state["scaler"]["scale"] == first.summary["loss_scale"] == 2.0**15
    assert state["scaler"]["_growth_tracker"] == 2  # finite steps since the last skip

    # The resumed run starts from the saved scale (not the initial 2**16) and count.
    resumed_mp = fp16()
    scales: list[float] = []
    probe = Probe(after_backward=overflow,
                  before_optimizer_step=lambda s: scales.append(resumed_mp.scaler.get_scale()))
    resumed = train(tmp_path / "a", [resumed_mp, probe], model=small_model(), max_duration="2ep",
                    load_path=ckpt, eval_interval=None)
    assert scales[0] == 2.0**15
    assert resumed.summary["skipped_steps"] == 2  # batch 4 overflowed too
    assert resumed.summary["loss_scale"] == 2.0**14


def test_fp16_training_tracks_fp32(tmp_path):
    fp32 = _epoch_losses([], tmp_path / "fp32", epochs=5)
    half = _epoch_losses([fp16()], tmp_path / "fp16", epochs=5)
    assert half != fp32
    _tracks_fp32(half, fp32)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU on this machine)")
def test_cuda_auto_dtype_and_fp16_scaler(tmp_path):
    expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    assert resolve_dtype("auto", "cuda") == expected
    model = tiny_model()
    train_data, eval_data = tiny_loaders()
    mp = fp16()
    seen: set = set()
    trainer = Trainer(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        train_data=train_data, eval_data=eval_data, max_duration="2ep",
        algorithms=[mp, Probe(after_forward=lambda s: seen.add(s.outputs.dtype))],
        run_dir=tmp_path / "run", device="cuda", progress_bar=False, verbose=False,
    )
    trainer.fit()
    assert seen == {torch.float16}
    assert mp.scaler is not None and mp.scaler.get_scale() > 0


def test_auto_follows_the_cpus_bf16_units(tmp_path, cpu_kind):
    native = cpu_kind in ("avx512_bf16", "amx")
    probe, seen = dtype_probe()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Unmeasured: each plugin's fallback, which follows the CPU's units.
        trainer = train(tmp_path, [MixedPrecision(), probe], max_duration="2ba", autotune=False)
    told = [str(w.message) for w in caught if "no bf16 units" in str(w.message)]
    if native:
        assert seen["conv"] == seen["outputs"] == {torch.bfloat16}
        assert trainer.summary["autocast_dtype"] == "bf16" and not told
    else:
        # Emulated bf16 would be many times slower than fp32: auto trains in fp32, says so.
        assert seen["conv"] == seen["outputs"] == seen["eval"] == {torch.float32}
        assert trainer.summary["autocast_dtype"] == "fp32"
        assert trainer.state.compute_dtype is None
        assert len(told) == 1 and f"this CPU ({cpu_kind})" in told[0]


def test_explicit_bf16_warns_only_on_a_cpu_without_bf16_units(tmp_path, cpu_kind):
    probe, seen = dtype_probe()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(tmp_path, [MixedPrecision(MixedPrecisionConfig(dtype="bf16")), probe], max_duration="1ba")
    told = [str(w.message) for w in caught if "emulated" in str(w.message)]
    assert len(told) == (0 if cpu_kind in ("avx512_bf16", "amx") else 1), told
    assert seen["conv"] == {torch.bfloat16}  # the user asked for it: honoured


def _overflow_always(state) -> None:
    state.model.fc.weight.grad[0, 0] = float("inf")


def test_fp16_skipping_every_step_is_reported(tmp_path):
    mp = fp16(warn_after_skips=3)
    with pytest.warns(RuntimeWarning, match="skipped 3 optimizer steps in a row") as caught:
        trainer = train(tmp_path, [mp, Probe(after_backward=_overflow_always)], model=small_model(),
                        max_duration="1ep", eval_interval=None)
    streak = [str(w.message) for w in caught if "in a row" in str(w.message)]
    assert len(streak) == 1 and "steps 1-3" in streak[0]  # once, naming the steps
    assert trainer.summary["skipped_steps"] == trainer.summary["longest_skip_streak"] == 4
    assert any("skipped 3 optimizer steps" in w for w in trainer.summary["warnings"])


def test_fp16_occasional_skips_are_not_reported(tmp_path):
    mp = fp16(warn_after_skips=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="mixed_precision: the fp16 GradScaler")
        trainer = train(tmp_path, [mp, Probe(after_backward=overflow)], model=small_model(),
                        max_duration="2ep", eval_interval=None)  # skips at batches 1 and 4
    assert trainer.summary["skipped_steps"] == 2 and trainer.summary["longest_skip_streak"] == 1
    assert "warnings" not in trainer.summary


def test_warn_after_skips_is_validated():
    with pytest.raises(ConfigError, match="warn_after_skips must be a whole number >= 1"):
        plugin_config(MixedPrecision, {"warn_after_skips": 0})
