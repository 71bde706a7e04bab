"""The evaluation service: top-1 and, with at least 5 classes, top-5 accuracy in the
eval records of metrics.jsonl and in summary.json."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import Probe, tiny_loaders, tiny_model
from slipstream import Trainer


def _fit(tmp_path, num_classes: int) -> tuple[Trainer, torch.Tensor, torch.Tensor]:
    logits: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []

    def keep(state):
        logits.append(state.outputs.float())
        targets.append(state.batch[1])

    train_data, eval_data = tiny_loaders(num_classes=num_classes)
    model = tiny_model(num_classes=num_classes)
    trainer = Trainer(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        train_data=train_data,
        eval_data=eval_data,
        max_duration="2ba",
        algorithms=[Probe(eval_batch_end=keep)],
        run_dir=tmp_path / "run",
        device="cpu",
        progress_bar=False,
        verbose=False,
    )
    trainer.fit()
    return trainer, torch.cat(logits), torch.cat(targets)


def test_top5_accuracy_is_reported_with_at_least_five_classes(tmp_path):
    trainer, logits, targets = _fit(tmp_path, num_classes=10)
    top5 = (logits.topk(5, dim=1).indices == targets[:, None]).any(dim=1).float().mean().item()
    top1 = (logits.argmax(dim=1) == targets).float().mean().item()
    metrics = trainer.state.eval_metrics
    assert metrics["accuracy_top5"] == pytest.approx(top5)
    assert metrics["accuracy"] == pytest.approx(top1)
    # A near-untrained 10-class model: top-5 is not top-1, so the two are told apart.
    assert metrics["accuracy_top5"] > metrics["accuracy"]
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    (final,) = [r for r in records if r["kind"] == "eval"]
    assert final["accuracy_top5"] == pytest.approx(top5)
    summary = json.loads((trainer.run_dir / "summary.json").read_text())
    assert summary["accuracy_top5"] == pytest.approx(top5)
    assert summary["best_accuracy_top5"] == pytest.approx(top5)


def test_no_top5_with_fewer_than_five_classes(tmp_path):
    trainer, _, _ = _fit(tmp_path, num_classes=4)
    assert set(trainer.state.eval_metrics) == {"loss", "accuracy"}
    summary = json.loads((trainer.run_dir / "summary.json").read_text())
    assert "accuracy_top5" not in summary


def _with_eval_data(tmp_path, eval_data, **kwargs) -> Trainer:
    model = tiny_model()
    return Trainer(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        train_data=tiny_loaders()[0],
        eval_data=eval_data,
        run_dir=tmp_path / "run",
        device="cpu",
        progress_bar=False,
        verbose=False,
        **{"max_duration": "2ep", "eval_interval": "1ep", **kwargs},
    )


def test_an_evaluation_of_no_samples_is_an_error_not_an_accuracy_of_0(tmp_path):
    from slipstream import ConfigError

    eval_data = tiny_loaders()[1]
    # Empty and sized: refused before anything is written.
    with pytest.raises(ConfigError, match=r"evaluation data is empty.*trainer.eval_interval: null"):
        _with_eval_data(tmp_path / "empty", [])
    assert not (tmp_path / "empty").exists()
    assert _with_eval_data(tmp_path / "off", [], eval_interval=None).fit()["status"] == "completed"
    # One pass only: the first evaluation counts, the second finds nothing.
    trainer = _with_eval_data(tmp_path / "once", (batch for batch in eval_data))
    with pytest.raises(ConfigError, match="no samples at step 8, after 64 at the evaluation before: it can be read"):
        trainer.fit()
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["accuracy"] > 0 for r in records if r["kind"] == "eval"] == [True]  # no record of nothing
    # Unsized and empty from the start.
    with pytest.raises(ConfigError, match="yielded no samples; check it"):
        _with_eval_data(tmp_path / "unsized", iter([])).fit()


def test_a_model_handed_over_in_eval_mode_trains_in_training_mode(tmp_path):
    modes: list[tuple[str, bool]] = []
    probe = Probe(
        before_forward=lambda s: modes.append(("train", s.model.training)),
        eval_batch_start=lambda s: modes.append(("eval", s.model.training)),
    )
    model = tiny_model()
    model.eval()  # e.g. evaluated after loading weights, then handed over to fine-tune
    train_data, eval_data = tiny_loaders()
    Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), train_data=train_data,
            eval_data=eval_data, algorithms=[probe], max_duration="4ba", eval_interval="2ba",
            run_dir=tmp_path / "run", progress_bar=False, verbose=False).fit()  # fmt: skip
    assert {mode for kind, mode in modes if kind == "train"} == {True}
    assert {mode for kind, mode in modes if kind == "eval"} == {False}
    assert [kind for kind, _ in modes].count("train") == 4


def test_a_part_a_plugin_keeps_in_eval_mode_stays_there_after_each_evaluation(tmp_path):
    """A plugin freezes the batch-norm layers at fit_start (docs/plugins.md, "Training
    mode"); the evaluations in between must not put them back into training, where their
    running statistics would move again without a word."""
    model = tiny_model()
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms

    def freeze(state):
        for norm in norms:
            norm.eval()

    seen: list[tuple[bool, bool]] = []  # (model, every norm) in training mode, per batch
    probe = Probe(
        fit_start=freeze,
        before_forward=lambda s: seen.append((s.model.training, any(n.training for n in norms))),
    )
    train_data, eval_data = tiny_loaders()
    frozen = [n.running_mean.clone() for n in norms]
    Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), train_data=train_data,
            eval_data=eval_data, algorithms=[probe], max_duration="4ba", eval_interval="1ba",
            run_dir=tmp_path / "run", progress_bar=False, verbose=False).fit()  # fmt: skip
    assert seen == [(True, False)] * 4  # three evaluations came in between
    for norm, before in zip(norms, frozen, strict=True):
        assert torch.equal(norm.running_mean, before)


def test_issue_44_eval_output_is_strict_json(tmp_path, monkeypatch, capsys):
    """Issue 44: `eval` wrote a NaN loss into its JSON (a NaN token no strict reader
    takes); now null, with the keys named under "nonfinite", printed and written."""
    from slipstream.cli.main import main

    monkeypatch.setattr(
        "slipstream.run.inference.evaluate_checkpoint",
        lambda *a, **k: {"loss": float("nan"), "accuracy": 0.5, "samples": 4},
    )
    out = tmp_path / "eval.json"
    assert main(["eval", "-c", str(tmp_path / "any.pt"), "-o", str(out)]) == 0

    def refuse(constant):
        raise AssertionError(f"{constant} in the JSON")

    printed = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert printed == json.loads(out.read_text(), parse_constant=refuse)
    assert printed["loss"] is None and printed["nonfinite"] == ["loss"]
