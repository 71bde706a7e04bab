"""sam: a second forward/backward at w + rho * g / (||g|| + eps) inside the backward step."""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from slipstream_sam import Sam, SamConfig, perturb, restore, sam_applies, sam_step

from helpers import Probe, tiny_loaders, train
from slipstream import ConfigError, SlipstreamError
from slipstream.plugins.discovery import discover, plugin_config

LR = 0.05


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(OrderedDict(
        conv=torch.nn.Conv2d(3, 8, 3, stride=2, padding=1),
        bn=torch.nn.BatchNorm2d(8),
        act=torch.nn.ReLU(),
        pool=torch.nn.AdaptiveAvgPool2d(2),
        flat=torch.nn.Flatten(),
        fc=torch.nn.Linear(32, 4),
    ))


def sam(**kwargs) -> Sam:
    return Sam(SamConfig(**kwargs))


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def run(tmp_path, algos, max_duration="1ba", **kwargs):
    """Train small_model; returns the trainer, the batches the model got and the
    number of forward calls per training batch."""
    model = kwargs.pop("model", None) or small_model()
    batches: list[tuple[torch.Tensor, torch.Tensor]] = []
    calls: list[int] = []
    dtypes: list[torch.dtype] = []

    def counted(module, args, output):
        if module.training:
            calls[-1] += 1
            dtypes.append(output.dtype)

    model.register_forward_hook(counted)
    probe = Probe(
        before_forward=lambda s: (batches.append((s.batch[0].clone(), s.batch[1].clone())), calls.append(0)),
    )
    kwargs.setdefault("eval_interval", None)
    kwargs.setdefault("checkpoint_interval", None)
    trainer = train(tmp_path, [*algos, probe], model=model, max_duration=max_duration, lr=LR, **kwargs)
    return trainer, batches, calls, dtypes


def by_hand(model, batch, loss_fn=F.cross_entropy, rho=0.05, eps=1e-12, use_sam=True):
    """One SGD(momentum 0.9) step, SAM as the paper and Composer write it, in plain torch."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, y = batch
    loss_fn(model(x), y).backward()
    if use_sam:
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.norm(torch.stack([p.grad.norm(p=2) for p in params]), p=2)
        scale = rho / (norm + eps)
        w = [p.detach().clone() for p in params]
        buffers = [b.clone() for b in model.buffers()]
        with torch.no_grad():
            for p in params:
                p.add_(p.grad * scale)
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        with torch.no_grad():
            for p, saved in zip(params, w, strict=True):
                p.copy_(saved)
            for b, saved in zip(model.buffers(), buffers, strict=True):
                b.copy_(saved)
    opt.step()
    return model


def assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), (x - y).abs().max()


def test_one_step_is_a_hand_written_sam_step_and_not_plain_sgd(tmp_path):
    trainer, batches, calls, _ = run(tmp_path, [sam()])
    assert calls == [2]  # two forward passes in the one step
    expected = by_hand(small_model(), batches[0])
    assert_same(weights(trainer.state.model), weights(expected))
    plain = by_hand(small_model(), batches[0], use_sam=False)
    assert any(not torch.equal(a, b) for a, b in zip(weights(trainer.state.model), weights(plain), strict=True))
    assert trainer.summary["sam_steps"] == 1


def test_functional_sam_step_equals_the_plugin(tmp_path):
    trainer, batches, _, _ = run(tmp_path, [sam(rho=0.2)])
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, y = batches[0]

    def closure():
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    loss = sam_step(model, opt, closure, rho=0.2)
    assert loss.ndim == 0
    assert_same(weights(model), weights(trainer.state.model))


def test_perturb_and_restore_are_exact():
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))
    c = torch.nn.Parameter(torch.randn(2))  # no gradient: not moved
    a.grad, b.grad = torch.tensor([1.0, 2.0, 2.0]), torch.full((2, 2), 2.0)  # total norm 5
    before = [t.detach().clone() for t in (a, b, c)]
    moved, saved = perturb([a, b, c], rho=0.5, epsilon=0.0)
    assert len(moved) == 2
    torch.testing.assert_close(a.detach() - before[0], a.grad * 0.1)
    torch.testing.assert_close(b.detach() - before[1], b.grad * 0.1)
    assert torch.equal(c.detach(), before[2])
    restore(moved, saved)
    assert all(torch.equal(t.detach(), s) for t, s in zip((a, b, c), before, strict=True))


def test_interval_2_alternates_plain_and_sam_steps(tmp_path):
    trainer, batches, calls, _ = run(tmp_path, [sam(interval=2)], max_duration="4ba")
    assert calls == [1, 2, 1, 2]
    assert [sam_applies(s, 2) for s in range(4)] == [False, True, False, True]
    assert trainer.summary["sam_steps"] == 2
    # Step 0 is plain SGD; step 1 is SAM.
    first, _, _, _ = run(tmp_path / "one", [sam(interval=2)], max_duration="1ba")
    assert_same(weights(first.state.model), weights(by_hand(small_model(), batches[0], use_sam=False)))


def test_off_is_plain_sgd(tmp_path):
    plain, batches, calls, _ = run(tmp_path, [], max_duration="2ba")
    assert calls == [1, 1]
    # Installed but never due (interval beyond the run): bit-identical to no sam at all.
    idle, _, calls, _ = run(tmp_path / "idle", [sam(interval=100)], max_duration="2ba")
    assert calls == [1, 1]
    assert all(torch.equal(a, b) for a, b in zip(weights(plain.state.model), weights(idle.state.model), strict=True))
    with_sam, _, _, _ = run(tmp_path / "sam", [sam()], max_duration="2ba")
    assert not all(
        torch.equal(a, b) for a, b in zip(weights(plain.state.model), weights(with_sam.state.model), strict=True)
    )


def test_second_pass_uses_label_smoothing_and_bf16_autocast(tmp_path):
    info = discover()
    ls_cls, mp_cls = info["label_smoothing"].cls, info["mixed_precision"].cls
    ls = ls_cls(plugin_config(ls_cls, {"smoothing": 0.1}))
    trainer, batches, _, _ = run(tmp_path, [sam(), ls])
    expected = by_hand(small_model(), batches[0], loss_fn=lambda o, y: F.cross_entropy(o, y, label_smoothing=0.1))
    assert_same(weights(trainer.state.model), weights(expected))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mp = mp_cls(plugin_config(mp_cls, {"dtype": "bf16"}))
        trainer, _, calls, dtypes = run(tmp_path / "bf16", [sam(), mp])
    assert [a.name for a in trainer.algorithms][:2] == ["mixed_precision", "sam"]
    assert calls == [2] and dtypes == [torch.bfloat16, torch.bfloat16]


def test_resume_mid_run_is_exact(tmp_path):
    algos = lambda: [sam(interval=2, rho=0.1)]  # noqa: E731
    straight, *_ = run(tmp_path / "straight", algos(), max_duration="6ba")
    half, *_ = run(tmp_path / "half", algos(), max_duration="3ba", checkpoint_interval="3ba")
    latest = half.run_dir / "checkpoints" / "latest.pt"
    resumed, _, calls, _ = run(tmp_path / "resumed", algos(), max_duration="6ba", load_path=latest)
    assert calls == [2, 1, 2]  # steps 3, 4, 5: SAM on the odd ones, as in the straight run
    assert all(
        torch.equal(a, b) for a, b in zip(weights(straight.state.model), weights(resumed.state.model), strict=True)
    )


def test_bad_options_are_one_line():
    for bad, allowed in (({"rho": 0}, "rho must be a finite number > 0"),
                         ({"epsilon": -1.0}, "epsilon must be"),
                         ({"interval": 0}, "interval must be"),
                         ({"interval": 1.5}, "algorithms.sam.interval"),
                         ({"radius": 1}, "radius")):
        with pytest.raises(ConfigError) as error:
            plugin_config(Sam, bad)
        message = str(error.value)
        assert "\n" not in message and message.startswith("algorithms.sam") and allowed in message
    with pytest.raises(ValueError, match="rho must be"):
        perturb([], rho=-1.0)


def test_refuses_grad_accumulation_and_fp16_by_name(tmp_path):
    info = discover()
    ga_cls, mp_cls = info["grad_accumulation"].cls, info["mixed_precision"].cls
    train_data, eval_data = tiny_loaders()
    model = small_model()
    with pytest.raises(SlipstreamError, match="grad_accumulation") as error:
        train(tmp_path, [sam(), ga_cls(plugin_config(ga_cls, {"steps": 2}))], model=model, max_duration="1ba")
    assert "sam" in str(error.value) and "\n" not in str(error.value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError, match=r"algorithms.sam: .*fp16.*dtype=bf16"):
            train(tmp_path / "fp16", [sam(), mp_cls(plugin_config(mp_cls, {"dtype": "fp16"}))],
                  model=copy.deepcopy(model), max_duration="1ba")
