"""Multi-label classification as a second task: the built-in synthetic_multilabel dataset
(several shapes per image, multi-hot float targets), trained with loss.name=bce through the
engine, and dict batches taken apart by one mapping where a batch enters the loop."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from helpers import Probe, tiny_model
from slipstream import ConfigError, Trainer
from slipstream.cli.main import main
from slipstream.data.multilabel import LABELS, SyntheticMultiLabel
from slipstream.data.sources import DataRequest, build_dataset_plugin
from slipstream.data.stats import DATASET_STATS
from slipstream.data.synthetic import SHAPES
from slipstream.models import build_loss
from slipstream.services.batches import as_pair, check_pair, to_device

# -- the dataset ---------------------------------------------------------------------------


def test_the_dataset_is_a_function_of_the_seed_and_labels_each_image_with_its_shapes():
    a = SyntheticMultiLabel(12, 16, 4, seed=3, split="train", max_shapes=3)
    again = SyntheticMultiLabel(12, 16, 4, seed=3, split="train", max_shapes=3)
    assert torch.equal(a.images, again.images) and torch.equal(a.targets, again.targets)
    longer = SyntheticMultiLabel(20, 16, 4, seed=3, split="train", max_shapes=3)
    assert torch.equal(longer.images[:12], a.images)  # sample i does not depend on the split's size
    other_seed, val = SyntheticMultiLabel(12, 16, 4, seed=4), SyntheticMultiLabel(12, 16, 4, seed=3, split="val")
    assert not torch.equal(other_seed.targets, a.targets) and not torch.equal(val.images, a.images)
    assert torch.equal(SyntheticMultiLabel(12, 32, 4, seed=3).targets, a.targets)  # the same scenes at 32 px

    image, target = a[0]
    assert image.dtype == torch.uint8 and image.shape == (3, 16, 16)
    assert target.dtype == torch.float32 and target.shape == (4,)
    assert set(a.targets.unique().tolist()) == {0.0, 1.0}
    shown = a.targets.sum(dim=1)
    assert shown.min() >= 1 and shown.max() <= 3 and (shown >= 2).any()  # several shapes per image
    assert a.classes == list(LABELS[:4]) and sorted(LABELS) == sorted(SHAPES)


@pytest.mark.parametrize(
    ("options", "told"),
    [
        ({"num_classes": 11}, r"num_classes must be a whole number in \[2, 10\] \(one per shape\), got 11"),
        ({"num_classes": 3, "max_shapes": 4}, "max_shapes=4 is more than num_classes=3"),
        ({"max_shapes": 0}, r"max_shapes must be a whole number in \[1, 4\]"),
    ],
)
def test_bad_options_name_the_key_and_what_is_allowed(options, told):
    with pytest.raises(ConfigError, match=r"^data \(dataset synthetic_multilabel\): " + told):
        build_dataset_plugin({"name": "synthetic_multilabel", **options})


def _auroc(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per class: the chance that a positive image scores above a negative one (0.5: chance)."""
    return torch.stack(
        [
            (scores[targets[:, k] == 1, k, None] > scores[None, targets[:, k] == 0, k]).float().mean()
            for k in range(targets.shape[1])
        ]
    )


def _standard(images: torch.Tensor) -> torch.Tensor:
    mean, std = DATASET_STATS["synthetic_multilabel"]
    return (images.float() / 255 - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)


def test_a_tiny_model_learns_which_shapes_are_present_above_chance():
    torch.manual_seed(0)
    train_set = SyntheticMultiLabel(256, 16, 3, seed=0, split="train", max_shapes=2)
    val_set = SyntheticMultiLabel(96, 16, 3, seed=0, split="val", max_shapes=2)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(32, 3),
    )  # fmt: skip
    optimizer = torch.optim.Adam(model.parameters(), 3e-3)
    x, y, x_val = _standard(train_set.images), train_set.targets, _standard(val_set.images)
    before = _auroc(model(x_val).detach(), val_set.targets)
    for _ in range(5):
        for i in range(0, len(x), 32):
            loss = F.binary_cross_entropy_with_logits(model(x[i : i + 32]), y[i : i + 32])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        after = _auroc(model(x_val), val_set.targets)
    assert after.mean() > 0.65 and (after > 0.5).all(), (before, after)  # every shape above chance (0.5)
    assert after.mean() > before.mean() + 0.1


# -- through the engine --------------------------------------------------------------------


def fit(tmp_path, probe: Probe, train_data, eval_data, num_classes: int = 4, **options) -> tuple[Trainer, dict]:
    """Two steps of the tiny model and an evaluation, with ``probe`` watching; the trainer and its summary."""
    model = tiny_model(num_classes=num_classes)
    trainer = Trainer(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), train_data=train_data,
        eval_data=eval_data, max_duration="2ba", algorithms=[probe], run_dir=tmp_path / "run", device="cpu",
        progress_bar=False, verbose=False, checkpoint_interval=None, **options,
    )  # fmt: skip
    return trainer, trainer.fit()


def test_the_dataset_plugin_trains_with_bce_on_multi_hot_batches_and_evaluates_as_multi_label(tmp_path):
    plugin = build_dataset_plugin({"name": "synthetic_multilabel", "num_classes": 3, "train_size": 32, "val_size": 16})
    assert type(plugin).task == "multilabel"
    built = plugin.build(DataRequest(image_size=16, batch_size=16, eval_batch_size=8))
    seen, evaluated = [], []
    probe = Probe(
        before_forward=lambda s: seen.append(s.batch[1]),
        eval_batch_end=lambda s: evaluated.append((s.outputs.detach().clone(), s.batch[1].clone())),
    )
    trainer, summary = fit(
        tmp_path, probe, built.train, built.eval, num_classes=3, loss_fn=build_loss("bce"), normalize=built.stats
    )
    assert [t.shape for t in seen[:2]] == [(16, 3)] * 2 and all(t.dtype == torch.float32 for t in seen)
    assert summary["status"] == "completed"
    # The defaults of multi-hot targets; the loss is BCE with logits (the mean over classes, then
    # over samples), not the softmax cross-entropy bce reports for single-label targets.
    metrics = trainer.state.eval_metrics
    assert {"loss", "map", "f1_samples"} <= set(metrics) and "accuracy" not in metrics
    logits, targets = (torch.cat(parts) for parts in zip(*evaluated, strict=True))
    assert len(logits) == 16
    assert metrics["loss"] == pytest.approx(F.binary_cross_entropy_with_logits(logits, targets).item(), rel=1e-5)
    assert metrics["loss"] != pytest.approx(F.cross_entropy(logits, targets).item(), rel=1e-3)


def test_a_cli_run_records_the_multi_label_metrics_and_keeps_best_by_map(tmp_path, capsys):
    run_dir = tmp_path / "run"
    small = ["data.num_classes=3", "data.train_size=32", "data.val_size=16", "data.image_size=16",
             "data.batch_size=8", "model.name=test_resnet", "trainer.max_duration=3ba"]  # fmt: skip
    args = ["train", "data.name=synthetic_multilabel", "loss.name=bce", *small, "trainer.eval_interval=1ba",
            "trainer.best_metric=map", "trainer.progress_bar=false", "trainer.target_accuracy=0.01",
            "--callbacks", "early_stopping", f"trainer.run_dir={run_dir}"]  # fmt: skip
    # The target and early stopping's default monitor (accuracy) read map in a multi-label run.
    assert main(args) == 0
    assert "does not measure" not in capsys.readouterr().err  # no warning left about the evaluation
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    evals = [r for r in map(json.loads, lines) if r["kind"] == "eval"]
    assert len(evals) == 3 and all({"loss", "map", "f1_samples"} <= set(r) and "accuracy" not in r for r in evals)
    assert all(0.3 < r["loss"] < 1.5 for r in evals)  # BCE of 3 sigmoids near chance (ln 2), not a softmax's
    best = max(evals, key=lambda r: r["map"])
    kept = torch.load(run_dir / "checkpoints" / "best.pt", map_location="cpu", weights_only=False)["best"]
    assert kept["metric"] == "map" and kept["value"] == pytest.approx(best["map"]) and kept["step"] == best["step"]
    # The summary holds the run's only set's final and best values of every metric it evaluated.
    summary = json.loads((run_dir / "summary.json").read_text())
    sets = summary["eval_sets"]
    assert sets["val"]["final"]["map"] == evals[-1]["map"] and sets["val"]["best"]["map"] == best["map"]
    assert summary["target_metric"] == "map" and summary["time_to_target_s"] == evals[0]["elapsed_s"]
    # slipstream eval of the checkpoint measures what the run did, by the same defaults.
    out = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(run_dir / "checkpoints" / "best.pt"), "-o", str(out)]) == 0
    measured = json.loads(out.read_text())
    assert measured["map"] == pytest.approx(best["map"]) and measured["loss"] == pytest.approx(best["loss"])
    assert "f1_samples" in measured and "accuracy" not in measured
    # accuracy has no one true class here; mAP none in single-label targets: both refused by name.
    assert main(["train", "data.name=synthetic_multilabel", "loss.name=bce", "evaluation.metrics=[accuracy]",
                 f"trainer.run_dir={tmp_path / 'no'}"]) == 2  # fmt: skip
    assert "'accuracy' applies to multiclass targets; this run's are multi-hot" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


def test_the_softmax_cross_entropy_is_refused_for_multi_hot_targets_before_anything_is_written(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(["train", "data.name=synthetic_multilabel", f"trainer.run_dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 2 and not run_dir.exists()
    assert "data.name=synthetic_multilabel has multi-hot targets" in err and "use loss.name=bce" in err


# -- dict batches --------------------------------------------------------------------------


class DictSamples(Dataset):
    """Samples as a Hugging Face dataset gives them: a dict, with a key besides the pair."""

    def __init__(self, n: int = 32) -> None:
        self.x = torch.rand(n, 3, 16, 16, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.x[i], "labels": torch.tensor(i % 4), "index": torch.tensor(i)}


def test_a_dict_batch_becomes_inputs_targets_and_the_rest_in_one_place():
    x, y = torch.ones(2, 3), torch.zeros(2)
    assert as_pair({"image": x, "label": y}) == (x, y)
    inputs, targets, rest = as_pair({"label": y, "image": x, "id": 7})  # order of the keys does not matter
    assert inputs is x and targets is y and rest == {"id": 7}
    assert as_pair({"images": x, "targets": y, "image": y})[0] is y  # the first key of the documented order
    moved = to_device({"inputs": x, "target": y, "extra": {"w": x}}, torch.device("meta"))
    assert type(moved) is tuple and all(t.device.type == "meta" for t in (moved[0], moved[1], moved[2]["extra"]["w"]))
    unknown = {"img": x, "cls": y}
    assert as_pair(unknown) is unknown
    told = r"or a dict with inputs under one of image/.*got a dict with keys \['cls', 'img'\]"
    with pytest.raises(ConfigError, match=told):
        check_pair(to_device(unknown, torch.device("cpu")), "training")


def test_dict_batches_train_and_evaluate_and_plugins_see_the_tuple(tmp_path):
    seen: dict[str, list] = {"train": [], "eval": []}
    probe = Probe(
        batch_start=lambda s: seen["train"].append(s.batch),
        eval_batch_start=lambda s: seen["eval"].append(s.batch),
    )
    data = DataLoader(DictSamples(), batch_size=8)
    trainer, _ = fit(tmp_path, probe, data, data)
    for batch in seen["train"] + seen["eval"]:
        assert type(batch) is tuple and len(batch) == 3
        inputs, targets, rest = batch
        assert inputs.shape == (8, 3, 16, 16) and targets.dtype == torch.int64 and set(rest) == {"index"}
    assert len(seen["train"]) == 2 and len(seen["eval"]) == 4
    assert 0.0 <= trainer.state.eval_metrics["accuracy"] <= 1.0
