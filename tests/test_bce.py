"""``loss.name=bce``: timm's BinaryCrossEntropy, with label_smoothing and mixup's soft
targets, evaluated as cross-entropy, from the command line."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from slipstream_label_smoothing import LabelSmoothing, smoothed_loss
from slipstream_mixup import Mixup
from timm.data.mixup import mixup_target
from timm.loss import BinaryCrossEntropy as TimmBCE

from helpers import TINY_RUN, Probe, error_lines, tiny_loaders, tiny_model
from slipstream import ConfigError, Trainer
from slipstream.cli.main import main
from slipstream.models import BinaryCrossEntropy, build_loss
from slipstream.plugins.discovery import PluginInfo, discover, plugin_config

K = 4


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, K, generator=g) * 3, torch.randint(0, K, (16,), generator=g)


@pytest.mark.parametrize("kwargs", [{}, {"smoothing": 0.1}, {"pos_weight": 2.0, "sum_classes": True},
                                    {"target_threshold": 0.2, "smoothing": 0.3},
                                    {"pos_weight": [1.0, 2.0, 0.5, 1.0], "weight": [1.0, 1.0, 2.0, 3.0]}])
def test_equals_timm_on_class_indices(kwargs) -> None:
    logits, targets = batch()
    ours = build_loss("bce", **kwargs)(logits, targets)
    # timm's class smooths by 0.1 unless told, and takes per-class weights as tensors.
    timm_kwargs = {"smoothing": 0.0, **{k: torch.tensor(v) if isinstance(v, list) else v for k, v in kwargs.items()}}
    assert torch.equal(ours, TimmBCE(**timm_kwargs)(logits, targets))


@pytest.mark.parametrize("s", [0.0, 0.1])
def test_soft_targets_equal_timms_mixup_then_bce(s) -> None:
    # timm smooths mixed targets in its Mixup, and its BCE takes them as they come; here
    # the mixing plugins hand unsmoothed targets and the loss smooths them: same result.
    logits, targets = batch(1)
    mixed = mixup_target(targets, K, lam=0.7)
    ours = build_loss("bce", smoothing=s)(logits, mixed)
    torch.testing.assert_close(ours, TimmBCE(smoothing=0.0)(logits, mixup_target(targets, K, lam=0.7, smoothing=s)))
    assert torch.equal(build_loss("bce")(logits, mixed), TimmBCE(smoothing=0.0)(logits, mixed))


def test_target_threshold_makes_both_classes_of_a_mixed_pair_positives() -> None:
    logits, targets = batch(2)
    mixed = mixup_target(targets, K, lam=0.7)  # shares 0.7 and 0.3 (1.0 where a pair agrees)
    loss = build_loss("bce", target_threshold=0.2)
    binary = loss.targets(logits, mixed)
    assert torch.equal(binary, (mixed > 0.2).float()) and set(binary.unique().tolist()) == {0.0, 1.0}
    assert (binary.sum(1) == 2).any()  # a pair of two classes: two positives
    assert torch.equal(loss(logits, mixed), TimmBCE(smoothing=0.0, target_threshold=0.2)(logits, mixed))
    assert not torch.equal(loss(logits, mixed), build_loss("bce")(logits, mixed))


def test_label_smoothing_smooths_bce_and_off_is_plain() -> None:
    logits, targets = batch(3)
    plain = build_loss("bce")
    smoothed = smoothed_loss(plain, 0.1)
    assert isinstance(smoothed, BinaryCrossEntropy) and smoothed.smoothing == 0.1
    assert torch.equal(smoothed(logits, targets), TimmBCE(smoothing=0.1)(logits, targets))
    assert not torch.equal(smoothed(logits, targets), plain(logits, targets))
    assert torch.equal(smoothed_loss(plain, 0.0)(logits, targets), plain(logits, targets))
    with pytest.raises(ConfigError, match="already smooths labels") as error:
        smoothed_loss(build_loss("bce", smoothing=0.1), 0.1)
    assert "\n" not in str(error.value)


def test_mixup_and_label_smoothing_train_with_bce_and_evaluation_reports_cross_entropy(tmp_path) -> None:
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    evaluated: list[float] = [0.0, 0]
    probe = Probe(
        after_loss=lambda s: seen.append((s.loss.detach(), TimmBCE(smoothing=0.0)(
            s.outputs.detach(), s.batch[1] * 0.9 + 0.1 / K))),
        eval_batch_end=lambda s: evaluated.__setitem__(
            slice(0, 2), [evaluated[0] + F.cross_entropy(s.outputs, s.batch[1], reduction="sum").item(),
                          evaluated[1] + len(s.batch[1])]),
    )
    algos = [Mixup(plugin_config(Mixup, {"alpha": 1.0})), LabelSmoothing(plugin_config(LabelSmoothing, {})), probe]
    training, evaluation = tiny_loaders(n=32)
    model = tiny_model()
    trainer = Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), train_data=training,
                      eval_data=evaluation, max_duration="2ba", algorithms=algos, run_dir=tmp_path, device="cpu",
                      loss_fn=build_loss("bce"), checkpoint_interval=None, progress_bar=False, verbose=False,
                      installed={**discover(), "probe": PluginInfo("probe", "tests", "0", "helpers", cls=Probe)})
    trainer.fit()
    assert len(seen) == 2
    for loss, expected in seen:  # mixed soft targets, smoothed by 0.1, through BCE
        torch.testing.assert_close(loss, expected)
    assert all(torch.isfinite(p).all() for p in trainer.state.model.parameters())
    assert trainer.state.eval_metrics["loss"] == pytest.approx(evaluated[0] / evaluated[1], rel=1e-5)


def test_bad_options_are_one_line_errors() -> None:
    for kwargs, says in (({"smothing": 0.1}, "did you mean 'smoothing'"),
                         ({"smoothing": 1.0}, "loss.kwargs.smoothing must be a number in [0, 1)"),
                         ({"target_threshold": 1.5}, "loss.kwargs.target_threshold must be"),
                         ({"pos_weight": 0}, "loss.kwargs.pos_weight must be a positive number"),
                         ({"weight": [1, -1]}, "loss.kwargs.weight must be a list of positive numbers"),
                         ({"reduction": "none"}, "loss.kwargs.reduction must be mean or sum")):
        with pytest.raises(ConfigError) as error:
            build_loss("bce", **kwargs)
        assert "\n" not in str(error.value) and says in str(error.value), str(error.value)
    with pytest.raises(ConfigError, match="loss.kwargs.weight has 3 entries but the model has 4 classes"):
        build_loss("bce", weight=[1, 2, 3]).check_num_classes(4)


def test_a_bce_run_from_the_command_line(tmp_path, capsys) -> None:
    run_dir = tmp_path / "run"
    code = main(["train", "--quiet", *TINY_RUN, "trainer.max_duration=2ba", f"trainer.run_dir={run_dir}",
                 "loss.name=bce", "loss.kwargs.target_threshold=0.2", "--algorithms", "label_smoothing,mixup"])
    assert code == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records][-1] == "eval" and records[-1]["loss"] > 0
    code = main(["train", "--quiet", *TINY_RUN, f"trainer.run_dir={tmp_path / 'bad'}", "loss.name=bce",
                 "loss.kwargs.pos_weight=-1"])
    err = capsys.readouterr().err
    assert code != 0 and len(error_lines(err)) == 1 and "loss.kwargs.pos_weight" in err, err
    assert not (tmp_path / "bad").exists()  # refused before anything was written
