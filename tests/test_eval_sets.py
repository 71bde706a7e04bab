"""Several evaluation sets (issue 43 part 2): ``data.eval_sets`` / ``Trainer(eval_data={...})``
evaluated side by side, their records, summary, best.pt, ``slipstream eval --set``, and the
readers (compare, plot) on runs of one set and of several."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import TINY_RUN, error_lines, tiny_loaders, tiny_model
from slipstream import ConfigError, Trainer
from slipstream.cli.main import main
from slipstream.run.results import compare_runs, compare_runs_json, load_run, plot_runs


def _evals(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "eval"]


def test_two_sets_at_two_sizes_side_by_side_best_by_the_second_and_eval_of_one(tmp_path, capsys):
    run_dir = tmp_path / "run"
    sets = ["data.eval_sets.val={}", "data.eval_sets.val_24.eval_image_size=24"]
    args = [*TINY_RUN, *sets, "trainer.max_duration=3ba", "trainer.eval_interval=1ba"]
    assert main(["train", *args, "trainer.best_metric=val_24/accuracy", f"trainer.run_dir={run_dir}", "-q"]) == 0
    capsys.readouterr()
    records = _evals(run_dir)
    assert len(records) == 3
    for record in records:
        # The first set keeps the bare keys of a run of one set; the other is SET/METRIC.
        assert {"loss", "accuracy", "val_24/loss", "val_24/accuracy"} <= set(record)
        assert not any(key.startswith("val/") for key in record)
    # Each set its own data: evaluated at its own size, not the same numbers twice.
    assert any(r["loss"] != r["val_24/loss"] for r in records)
    summary = json.loads((run_dir / "summary.json").read_text())
    final = records[-1]
    assert summary["accuracy"] == final["accuracy"] and summary["eval_loss"] == final["loss"]
    first = {k: v for k, v in final.items() if k in ("loss", "accuracy", "accuracy_top5")}
    assert summary["eval_sets"]["val"]["final"] == first
    assert summary["eval_sets"]["val_24"]["final"]["loss"] == final["val_24/loss"]
    assert summary["eval_sets"]["val_24"]["best"]["loss"] == min(r["val_24/loss"] for r in records)
    best = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=False)["best"]
    assert best["metric"] == "val_24/accuracy"
    assert best["value"] == max(r["val_24/accuracy"] for r in records)

    # slipstream eval: every set, or one with --set at its own geometry.
    latest = run_dir / "checkpoints" / "latest.pt"
    out = tmp_path / "one.json"
    assert main(["eval", "-c", str(latest), "--set", "val_24", "-o", str(out)]) == 0
    one = json.loads(out.read_text())
    assert one["sets"] == ["val_24"] and one["eval_image_size"] == 24
    assert one["loss"] == pytest.approx(final["val_24/loss"], rel=1e-5)
    capsys.readouterr()
    assert main(["eval", "-c", str(latest), "--set", "val_99", "-o", str(tmp_path / "no.json")]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "val_99" in line and "val, val_24" in line and not (tmp_path / "no.json").exists()

    # compare shows every set.
    (row,) = compare_runs_json([load_run(run_dir)])
    assert row["val_24/final_accuracy_pct"] == pytest.approx(100 * final["val_24/accuracy"])


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        (["trainer.best_metric=val_2/accuracy"], ["trainer.best_metric='val_2/accuracy'", "val, val_24"]),
        (["data.eval_sets.val_24.crop_pct=2"], ["data.eval_sets.val_24", "crop_pct"]),
        (["data.eval_sets.val_24.colour=1"], ["data.eval_sets.val_24", "colour"]),
        (["trainer.best_metric=val/top9"], ["top9", "is not evaluated"]),
    ],
)
def test_bad_sets_are_one_line_before_anything_is_written(tmp_path, capsys, bad, words):
    run_dir = tmp_path / "run"
    sets = ["data.eval_sets.val={}", "data.eval_sets.val_24.eval_image_size=24"]
    assert main(["train", *TINY_RUN, *sets, *bad, f"trainer.run_dir={run_dir}"]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert all(word in line for word in words), line
    assert not run_dir.exists()


def test_two_sets_of_one_name_in_a_recipe_are_refused(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  eval_sets:\n    val: {}\n    val: {eval_image_size: 24}\n")
    assert main(["train", "--recipe", str(recipe), *TINY_RUN, f"trainer.run_dir={tmp_path / 'run'}"]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "'val' twice" in line and not (tmp_path / "run").exists()


def test_python_sets_by_name_and_a_set_not_evaluated(tmp_path):
    torch.set_num_threads(1)
    train, val = tiny_loaders(32)
    _, other = tiny_loaders(16, seed=1)
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="no evaluation set is named 'c'"):
        Trainer(model, optimizer, train, {"a": val, "b": other}, "1ba", run_dir=tmp_path / "no",
                best_metric="c/accuracy")  # fmt: skip
    with pytest.raises(ConfigError, match="without '/'"):
        Trainer(model, optimizer, train, {"a/b": val}, "1ba", run_dir=tmp_path / "no")
    assert not (tmp_path / "no").exists()
    # a/accuracy names the first set: its bare key; a monitor of another set keeps its SET/.
    from slipstream_early_stopping import EarlyStopping, EarlyStoppingConfig

    first = EarlyStopping(EarlyStoppingConfig(monitor="a/loss"))
    Trainer(model, optimizer, train, {"a": val, "b": other}, "1ba", run_dir=tmp_path / "no", callbacks=[first])
    stopping = EarlyStopping(EarlyStoppingConfig(monitor="b/loss", patience=5))
    t = Trainer(model, optimizer, train, {"a": val, "b": other}, "2ba", run_dir=tmp_path / "py",
                best_metric="a/accuracy", callbacks=[stopping], eval_interval="1ba", progress_bar=False,
                verbose=False)  # fmt: skip
    assert (first.config.monitor, stopping.config.monitor, stopping.config.mode) == ("loss", "b/loss", "min")
    t.fit()
    records = _evals(tmp_path / "py")
    assert all({"accuracy", "b/accuracy"} <= set(r) for r in records)
    best = torch.load(tmp_path / "py" / "checkpoints" / "best.pt", weights_only=False)["best"]
    assert best["metric"] == "accuracy" and best["value"] == max(r["accuracy"] for r in records)
    assert stopping.best == min(r["b/loss"] for r in records)


def test_a_resume_keeps_each_sets_best_of_the_whole_run(tmp_path):
    from slipstream.services.summary import resume_summary
    from slipstream.state import State

    log = tmp_path / "metrics.jsonl"
    records = [(1, 0.9, 0.5, 0.2), (2, 1.2, 0.4, 0.1), (3, 1.1, 0.45, 0.3)]  # step, loss, accuracy, b/accuracy
    log.write_text("".join(
        json.dumps({"kind": "eval", "step": s, "loss": lo, "accuracy": a, "b/loss": lo, "b/accuracy": b})
        + "\n" for s, lo, a, b in records
    ))  # fmt: skip
    state = State(model=torch.nn.Linear(1, 1), optimizer=None, max_duration=None, eval_sets={"a": [], "b": []})
    state.timestamp.batch = 3
    resume_summary(state, log, higher=lambda key: not key.endswith("loss"))
    sets = state.summary["eval_sets"]
    assert sets["a"]["best"] == {"loss": 0.9, "accuracy": 0.5} and sets["b"]["best"] == {"loss": 0.9, "accuracy": 0.3}
    assert sets["a"]["final"] == {"loss": 1.1, "accuracy": 0.45}


def test_a_run_of_one_set_reads_as_before_beside_one_of_two(tmp_path):
    """An old run directory (records with bare keys, no eval_sets in the summary) compares
    and plots as before beside a run of two sets, whose further set gets its columns."""
    runs = []
    for name, extra in (("old", ""), ("two", ', "v2/loss": 1.5, "v2/accuracy": 0.3')):
        path = tmp_path / name
        path.mkdir()
        (path / "metrics.jsonl").write_text(
            '{"kind": "train", "step": 1, "epoch": 0, "elapsed_s": 0.5, "loss": 2.0, "lr": 0.1}\n'
            f'{{"kind": "eval", "step": 1, "epoch": 1, "elapsed_s": 0.6, "loss": 1.9, "accuracy": 0.4{extra}}}\n'
        )
        (path / "summary.json").write_text(json.dumps({"status": "completed", "accuracy": 0.4, "wall_time_s": 1.0}))
        runs.append(load_run(path))
    old, two = compare_runs_json(runs)
    assert old["final_accuracy_pct"] == pytest.approx(40.0) and not any("/" in key for key in old)
    assert two["v2/final_accuracy_pct"] == pytest.approx(30.0) == two["v2/best_accuracy_pct"]
    header, _, old_line, two_line = compare_runs(runs).splitlines()[:4]
    assert "v2 final %" in header and "30.00" in two_line and "30.00" not in old_line
    assert "v2" not in compare_runs(runs[:1])
    assert plot_runs(runs, tmp_path / "runs.png").stat().st_size > 0


def test_a_set_of_its_own_folder_needs_no_train_split_and_must_name_the_same_classes(tmp_path, capsys):
    import shutil

    from helpers import colour_image_folder

    classes = {"a": (200, 0, 0), "b": (0, 200, 0)}
    tree = colour_image_folder(tmp_path / "tree", classes, per_class=4)
    shifted = colour_image_folder(tmp_path / "shifted", {"a": (150, 40, 40), "b": (40, 150, 40)}, per_class=3)
    shutil.rmtree(shifted / "train")  # as ImageNet-V2: an evaluation split alone
    run_dir = tmp_path / "run"
    common = ["model.name=test_resnet", "data.name=imagefolder", f"data.root={tree}", "data.image_size=8",
              "data.batch_size=4", "trainer.max_duration=2ba", "trainer.progress_bar=false", "-q"]  # fmt: skip
    shifted_set = ["data.eval_sets.val={}", f"data.eval_sets.shifted.root={shifted}"]
    assert main(["train", *common, *shifted_set, f"trainer.run_dir={run_dir}"]) == 0
    final = _evals(run_dir)[-1]
    assert {"accuracy", "shifted/accuracy"} <= set(final)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_sets"]["shifted"]["final"]["loss"] == final["shifted/loss"] != final["loss"]
    capsys.readouterr()

    # Class folders named otherwise (ImageNet-V2's 0..999 beside ImageNet's wnids) would
    # score each index as another class: refused, naming them, before anything is written.
    renamed = colour_image_folder(tmp_path / "renamed", {"0": (200, 0, 0), "1": (0, 200, 0)})
    other = ["data.eval_sets.val={}", f"data.eval_sets.v2.root={renamed}"]
    assert main(["train", *common, *other, f"trainer.run_dir={tmp_path / 'no'}"]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "data.eval_sets.v2" in line and "only in the set ['0', '1']" in line and "['a', 'b']" in line, line
    assert not (tmp_path / "no").exists()
