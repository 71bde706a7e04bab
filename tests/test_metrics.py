"""Evaluation metrics as plugins (issue 43): the built-ins against hand computations,
a metric of one's own by import path, the bad inputs refused up front, exact resume,
the reduction across ranks, and checkpoints of a Trainer built in Python evaluated and
exported."""

from __future__ import annotations

import json
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from helpers import TINY_RUN, error_lines, tiny_loaders, tiny_model
from slipstream import ConfigError, Trainer
from slipstream.plugins.metric import BUILTIN_SUMMARIES, MetricSet, metric_class, parse_metrics

# 6 samples, 3 classes: predictions 0,1,1 | 1,2,0 by row below; every class appears.
LOGITS = torch.tensor(
    [[3.0, 1.0, 0.0], [0.5, 2.0, 0.1], [0.2, 1.5, 0.3], [0.1, 2.5, 0.4], [0.0, 0.3, 1.9], [1.2, 0.4, 0.2]]
)
TARGETS = torch.tensor([0, 1, 2, 1, 2, 2])
PREDICTED = LOGITS.argmax(1)  # [0, 1, 1, 1, 2, 0]


def _computed(names, logits=LOGITS, targets=TARGETS, task="multiclass"):
    metrics = MetricSet(parse_metrics(names), num_classes=logits.shape[1], task=task)
    metrics.reset()
    indices = targets if task == "multilabel" else targets
    metrics.update(logits, logits, targets, indices)
    assert metrics.reduce(None) == len(logits)
    return metrics.compute()


def test_each_builtin_single_label_metric_against_a_hand_computation():
    names = ["loss", "accuracy", "balanced_accuracy", "f1_macro", "precision_macro", "recall_macro",
             "calibration_error", "confusion_matrix"]  # fmt: skip
    numbers, tables = _computed(names)
    # Per class (0, 1, 2): true positives 1, 2, 1; predicted 2, 3, 1; actual 1, 2, 3.
    precision, recall = [1 / 2, 2 / 3, 1 / 1], [1 / 1, 2 / 2, 1 / 3]
    f1 = [2 * p * r / (p + r) for p, r in zip(precision, recall, strict=True)]
    assert numbers["loss"] == pytest.approx(F.cross_entropy(LOGITS, TARGETS).item())
    assert numbers["accuracy"] == pytest.approx(4 / 6)
    assert numbers["precision_macro"] == pytest.approx(sum(precision) / 3)
    assert numbers["recall_macro"] == pytest.approx(sum(recall) / 3)
    assert numbers["balanced_accuracy"] == pytest.approx(sum(recall) / 3)
    assert numbers["f1_macro"] == pytest.approx(sum(f1) / 3)
    # ECE, 15 equal bins of confidence: |accuracy - confidence| weighted by each bin's share.
    confidence = LOGITS.softmax(1).max(1).values
    hit = (PREDICTED == TARGETS).float()
    bins = (confidence * 15).ceil().long() - 1
    ece = sum(abs(hit[bins == b].mean() - confidence[bins == b].mean()) * (bins == b).sum() / 6
              for b in bins.unique())  # fmt: skip
    assert numbers["calibration_error"] == pytest.approx(float(ece), abs=1e-6)
    assert tables == {"confusion_matrix": [[1, 0, 0], [0, 2, 0], [1, 1, 1]]}
    assert "confusion_matrix" not in numbers


def test_top5_and_the_multi_label_metrics_against_a_hand_computation():
    logits = torch.arange(12.0).repeat(3, 1)  # class 11 highest, then 10, ...
    numbers, _ = _computed(["accuracy_top5"], logits, torch.tensor([11, 7, 6]))
    assert numbers["accuracy_top5"] == pytest.approx(2 / 3)  # 11 and 7 are in the top 5, 6 is not
    logits = torch.tensor([[2.0, -1.0, 3.0], [-2.0, 1.0, -1.0], [1.0, 1.0, -3.0]])
    targets = torch.tensor([[1, 0, 0], [0, 1, 1], [1, 1, 0]])
    numbers, _ = _computed(["f1_samples", "map"], logits, targets, task="multilabel")
    # Predicted (logit > 0): {0, 2}, {1}, {0, 1} against {0}, {1, 2}, {0, 1}: F1 2*1/3, 2*1/3, 2*2/4.
    assert numbers["f1_samples"] == pytest.approx((2 / 3 + 2 / 3 + 1.0) / 3)
    # Average precision per label: label 0 ranks 2 (+), 1 (+), -2 -> 1; label 1 ranks 1 (+), 1 (+), -1: 1;
    # label 2 ranks 3 (-), -1 (+), -3 -> 1/2.
    assert numbers["map"] == pytest.approx((1 + 1 + 0.5) / 3)


def test_multi_hot_targets_choose_their_defaults_and_are_evaluated_with_bce():
    from slipstream.models import build_loss
    from slipstream.plugins.metric import data_task, task_best_metric

    class Rows(torch.utils.data.Dataset):
        task = "multilabel"

    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(Rows(), [0]))
    assert data_task(loader) == "multilabel" and data_task({"val": loader}) == "multilabel"
    assert data_task(torch.utils.data.DataLoader([(0, 1)])) == "multiclass"
    assert [s.name for s in parse_metrics(None, "multilabel")] == ["loss", "map", "f1_samples"]
    assert [s.name for s in parse_metrics(None)] == ["loss", "accuracy", "accuracy_top5"]
    assert task_best_metric("accuracy", "multilabel") == "map"
    assert task_best_metric("accuracy", "multiclass") == "accuracy"
    logits = torch.tensor([[2.0, -1.0, 3.0], [-2.0, 1.0, -1.0]])
    targets = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    bce = F.binary_cross_entropy_with_logits(logits, targets).item()  # the mean over classes and samples
    # The default cross-entropy and bce (which evaluates single-label targets as cross-entropy) alike.
    for loss_fn in (None, torch.nn.CrossEntropyLoss(label_smoothing=0.1), build_loss("bce")):
        metrics = MetricSet(parse_metrics(["loss"]), loss_fn=loss_fn, num_classes=3, task="multilabel")
        metrics.update(logits, logits, targets, targets)
        metrics.reduce(None)
        assert metrics.compute()[0]["loss"] == pytest.approx(bce)
    single = MetricSet(parse_metrics(["loss"]), loss_fn=build_loss("bce"), num_classes=3)
    single.update(logits, logits, torch.tensor([2, 1]), torch.tensor([2, 1]))
    single.reduce(None)
    assert single.compute()[0]["loss"] == pytest.approx(F.cross_entropy(logits, torch.tensor([2, 1])).item())


def test_the_listing_says_what_each_builtin_class_says():
    for name, summary in BUILTIN_SUMMARIES.items():
        assert metric_class(name).__doc__.strip().splitlines()[0] == summary


def test_the_engines_metrics_are_found_without_reading_entry_points_as_registered():
    """metric_class takes the engine's own names from a table, not the entry points
    (read per Trainer they were a third of a tiny run): the table must be what the
    package registers, so that listing and use agree."""
    from importlib.metadata import entry_points

    from slipstream.plugins.metric import ENGINE_METRICS, METRICS_GROUP

    registered = {ep.name: ep.value for ep in entry_points(group=METRICS_GROUP) if ep.dist.name == "slipstream"}
    assert registered == ENGINE_METRICS
    with mock.patch("slipstream.plugins.metric.installed_metrics", side_effect=AssertionError("entry points read")):
        assert [metric_class(n).__name__ for n in ("loss", "accuracy")] == ["Loss", "Accuracy"]


class MeanConfidence:
    """The mean softmax confidence, times ``scale``; lower is not better."""

    higher_is_better = False

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale
        self.reset()

    def reset(self) -> None:
        self.total, self.count = 0.0, 0

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.total += outputs.softmax(1).max(1).values.sum().item()
        self.count += len(outputs)

    def compute(self) -> dict[str, float]:
        return {"mean": self.scale * self.total / self.count, "count": self.count}


class Words(MeanConfidence):
    def compute(self) -> str:  # type: ignore[override]
        return "high"


def _fit(run_dir, **kwargs):
    train, val = tiny_loaders(n=16, batch_size=8, num_classes=4)
    model = tiny_model(num_classes=4)
    settings = dict(max_duration="4ba", eval_interval="2ba", checkpoint_interval="2ba", progress_bar=False,
                    verbose=False, device="cpu", autotune=False)  # fmt: skip
    trainer = Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), train_data=train,
                      eval_data=val, run_dir=run_dir, **{**settings, **kwargs})  # fmt: skip
    return trainer


def _evals(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "eval"]


def test_chosen_and_own_metrics_are_recorded_best_kept_and_resumed_exactly(tmp_path):
    metrics = ["accuracy", "f1_macro", "confusion_matrix", {"test_metrics:MeanConfidence": {"scale": 2.0}}]
    whole = _fit(tmp_path / "whole", metrics=metrics, best_metric="mean_confidence_mean")
    whole.fit()
    evals = _evals(tmp_path / "whole")
    assert [r["step"] for r in evals] == [2, 4]
    assert set(evals[0]) >= {"accuracy", "f1_macro", "mean_confidence_mean", "mean_confidence_count"}
    assert "loss" not in evals[0] and "confusion_matrix" not in evals[0]  # not chosen; a table goes to a file
    assert evals[0]["mean_confidence_count"] == 16
    table = json.loads((tmp_path / "whole" / "eval" / "confusion_matrix-ba4.json").read_text())
    assert table["step"] == 4 and sum(map(sum, table["value"])) == 16
    # best.pt keeps the lowest mean confidence: the metric says lower is better.
    best = torch.load(tmp_path / "whole" / "checkpoints" / "best.pt", weights_only=False)["best"]
    assert best["metric"] == "mean_confidence_mean"
    assert best["value"] == min(r["mean_confidence_mean"] for r in evals)
    # The run again from its step-2 checkpoint: the same records, to the bit.
    resumed = _fit(tmp_path / "whole", metrics=metrics, best_metric="mean_confidence_mean",
                   load_path=next((tmp_path / "whole" / "checkpoints").glob("ep*-ba2.pt")))  # fmt: skip
    with warnings.catch_warnings():  # a best.pt of step 4, past the resume, is set aside, saying so
        warnings.filterwarnings("ignore", message=".*best.pt is from step 4, past step 2")
        resumed.fit()
    again = _evals(tmp_path / "whole")
    drop = ("elapsed_s",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in again] == [
        {k: v for k, v in r.items() if k not in drop} for r in evals
    ]


def test_bad_metrics_are_one_line_errors_before_anything_is_written(tmp_path, capsys):
    run_dir = tmp_path / "run"
    cases = {
        r"unknown metric 'acuracy' \(did you mean 'accuracy'\?\); installed: accuracy, accuracy_top5": ["acuracy"],
        "'map' applies to multilabel targets; this run's are class indices": ["map"],
        r"'words'.compute\(\) returned str": ["test_metrics:Words"],
        "'accuracy_top5' needs at least 5 classes; the run has 4": ["accuracy_top5"],
    }
    for message, metrics in cases.items():
        with pytest.raises(ConfigError, match=message):
            _fit(run_dir, metrics=metrics)
    with pytest.raises(ConfigError, match="best_metric='loss' is not evaluated; the evaluation records accuracy"):
        _fit(run_dir, metrics=["accuracy"], best_metric="loss")
    with pytest.raises(ConfigError, match="callbacks.early_stopping.monitor='accuracy' is not evaluated"):
        _fit(run_dir, metrics=["loss"], best_metric="loss", callbacks=["early_stopping"])
    with pytest.raises(ConfigError, match="target_metric='accuracy' is not evaluated.*or set target_accuracy=null"):
        _fit(run_dir, metrics=["loss"], best_metric="loss", target_accuracy=0.5)
    assert not run_dir.exists()
    from slipstream.cli.main import main

    said = {
        "evaluation.metrics=[f1_macro, nope]": "unknown metric 'nope'",
        "evaluation.metrics=[map]": "'map' applies to multilabel targets",
        "trainer.best_metric=f1_macro": "trainer.best_metric='f1_macro' is not evaluated",
    }
    for bad, message in said.items():
        assert main(["train", *TINY_RUN, f"trainer.run_dir={run_dir}", bad]) == 2
        (line,) = error_lines(capsys.readouterr().err)
        assert line.startswith("slipstream: error: ") and message in line
    assert not run_dir.exists()


def test_states_are_reduced_across_ranks_and_a_distributed_samplers_padding_left_out():
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from slipstream.services.evaluation import real_samples

    logits, targets = torch.randn(7, 3, generator=torch.Generator().manual_seed(0)), torch.arange(7) % 3
    dataset = TensorDataset(logits, targets)
    names = ["loss", "accuracy", "f1_macro"]
    ranks, captured = [], []
    for rank in range(3):  # 7 samples on 3 ranks: torch pads to 9, ranks 1 and 2 get a repeat
        sampler = DistributedSampler(dataset, num_replicas=3, rank=rank, shuffle=False)
        loader = DataLoader(dataset, batch_size=2, sampler=sampler)
        real = real_samples(loader)
        assert real == [3, 2, 2][rank] and len(sampler) == 3
        seen = torch.cat([b[0] for b in loader])[:real], torch.cat([b[1] for b in loader])[:real]
        metrics = MetricSet(parse_metrics(names), num_classes=3)
        metrics.reset()
        metrics.update(seen[0], seen[0], seen[1], seen[1])
        metrics.reduce(lambda t: captured.append(t.clone()))
        ranks.append(metrics)
    total = sum(captured)
    counts = [m.reduce(lambda t: t.copy_(total)) for m in ranks]
    assert counts == [7, 7, 7]  # each sample counted once
    whole, _ = _computed(names[:2], logits, targets)
    for metrics in ranks:
        numbers, _ = metrics.compute()
        assert numbers["loss"] == pytest.approx(whole["loss"]) and numbers["accuracy"] == whole["accuracy"]


class Net(torch.nn.Module):
    """A model of one's own: not a timm model, so a checkpoint cannot name how to build it."""

    def __init__(self, num_classes: int = 4) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
        self.head = torch.nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def build(num_classes: int, **kwargs) -> Net:
    return Net(num_classes)


def test_a_checkpoint_of_a_trainer_built_in_python_evaluates_and_exports(tmp_path, capsys):
    from slipstream.cli.main import main

    train, val = tiny_loaders(n=16, num_classes=4)
    for name, model in (("timm", tiny_model(num_classes=4)), ("own", Net())):
        Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), train_data=train, eval_data=val,
                max_duration="1ba", run_dir=tmp_path / name, progress_bar=False, verbose=False,
                device="cpu", autotune=False).fit()  # fmt: skip
    data = ["data.name=synthetic", "data.num_classes=4", "data.image_size=16", "data.train_size=8", "data.val_size=8",
            "data.batch_size=8"]  # fmt: skip
    out = tmp_path / "eval.json"
    assert main(["eval", "-c", str(tmp_path / "timm"), "--metrics", "accuracy,f1_macro", "-o", str(out), *data,
                 "data.eval_image_size=24", "data.crop_pct=1.0"]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    assert set(result) >= {"accuracy", "f1_macro"} and "loss" not in result and result["samples"] == 8
    assert (result["eval_image_size"], result["crop_pct"]) == (24, 1.0)  # any resolution and crop
    capsys.readouterr()
    # Its own model: the commands say in one line to name the builder, and take it.
    assert main(["eval", "-c", str(tmp_path / "own"), *data]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "built in Python around a Net" in line and "--model package.module:build" in line
    assert main(["export", "-c", str(tmp_path / "own"), "-f", "torchscript", "-o", str(tmp_path / "m.pt"),
                 "--model", "test_metrics:build"]) == 0  # fmt: skip
    with pytest.warns(FutureWarning):  # torch.jit.load's deprecation
        exported = torch.jit.load(str(tmp_path / "m.pt"))
    assert exported(torch.rand(2, 3, 16, 16)).shape == (2, 4)
    # eval needs data (the checkpoint of a Python run names none): said in one line.
    capsys.readouterr()
    assert main(["eval", "-c", str(tmp_path / "own"), "--model", "test_metrics:build"]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "give the eval data, e.g. data.name=" in line
