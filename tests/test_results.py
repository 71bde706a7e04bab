"""Tests for slipstream.run.results over hand-written run directories."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from slipstream.run.results import (
    ResultsError,
    build_figure,
    compare_runs,
    compare_runs_json,
    load_run,
    plot_runs,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(
    root: Path,
    name: str,
    *,
    model: str = "resnet18",
    algorithms: tuple[str, ...] = (),
    accuracies: tuple[float, ...] = (0.5, 0.7, 0.6),
    wall_time_s: float = 100.0,
    samples_per_s: float = 500.0,
    eval_elapsed: tuple[float, ...] | None = None,
    mfu: float | None = 0.4,
    extra_lines: tuple[str, ...] = (),
    summary: bool = True,
    data: str = "name: synthetic\n  image_size: 32\n",
) -> Path:
    run_dir = root / name
    run_dir.mkdir(parents=True)
    algo_yaml = "".join(f"  {a}:\n    enabled: true\n" for a in algorithms) or "  {}\n"
    (run_dir / "config.yaml").write_text(
        f"model:\n  name: {model}\n"
        f"data:\n  {data}"
        "trainer:\n  max_duration: 2ep\n"
        f"algorithms:\n{algo_yaml}"
    )
    lines = []
    for step in range(1, 7):
        lines.append(
            json.dumps(
                {
                    "kind": "train",
                    "step": step,
                    "epoch": step // 4,
                    "elapsed_s": step * 10.0,
                    "loss": 2.0 / step,
                    "lr": 0.1 * step / 6,
                    "image_size": [16 if step < 4 else 32] * 2,
                    "samples_per_s": samples_per_s,
                    "mfu": mfu,
                }
            )
        )
    elapsed = eval_elapsed or tuple(20.0 * i for i in range(1, len(accuracies) + 1))
    for i, (acc, at) in enumerate(zip(accuracies, elapsed, strict=True), start=1):
        lines.append(
            json.dumps(
                {
                    "kind": "eval",
                    "step": 2 * i,
                    "epoch": i,
                    "elapsed_s": at,
                    "loss": 1.0,
                    "accuracy": acc,
                }
            )
        )
    lines.extend(extra_lines)
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if summary:
        (run_dir / "summary.json").write_text(
            json.dumps(
                {
                    "accuracy": accuracies[-1] if accuracies else None,
                    "wall_time_s": wall_time_s,
                    "samples_per_s": samples_per_s,
                    "algorithms": [
                        {"name": a, "version": "0.1.0", "config": {}} for a in algorithms
                    ],
                    "versions": {"torch": "2.x"},
                    "device": "cpu",
                    "world_size": 1,
                    "run_dir": str(run_dir),
                    "status": "completed",
                }
            )
        )
    return run_dir


# --------------------------------------------------------------------------- load_run


def test_load_run_reads_all_three_files(tmp_path: Path) -> None:
    run = load_run(make_run(tmp_path, "baseline", algorithms=("channels_last",)))
    assert run.name == "baseline"
    assert run.path == tmp_path / "baseline"
    assert run.config["model"]["name"] == "resnet18"
    assert run.config["data"]["image_size"] == 32
    assert len(run.train) == 6 and len(run.eval) == 3
    assert run.train[0]["image_size"] == [16, 16]
    assert run.summary is not None and run.summary["status"] == "completed"


def test_load_run_ignores_unknown_kinds_blank_lines_and_extra_keys(tmp_path: Path) -> None:
    extra = (
        "",
        json.dumps({"kind": "checkpoint", "step": 6, "path": "ckpt.pt"}),
        json.dumps({"kind": "train", "step": 7, "elapsed_s": 70.0, "loss": 0.1, "new_key": 1}),
        json.dumps({"step": 8}),
    )
    run = load_run(make_run(tmp_path, "r", extra_lines=extra))
    assert len(run.train) == 7 and len(run.eval) == 3
    assert run.train[-1]["new_key"] == 1


def test_load_run_without_summary_or_config(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "crashed", summary=False)
    (run_dir / "config.yaml").unlink()
    run = load_run(run_dir)
    assert run.summary is None
    assert run.config == {}
    assert len(run.train) == 6


def test_not_a_run_dir_names_path_and_expected_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ResultsError) as info:
        load_run(empty)
    message = str(info.value)
    assert str(empty) in message
    assert "metrics.jsonl" in message and "summary.json" in message


def test_not_a_run_dir_points_at_runs_inside_it(tmp_path: Path) -> None:
    make_run(tmp_path / "runs", "a")
    with pytest.raises(ResultsError, match="contains 1 run directories: a"):
        load_run(tmp_path / "runs")


def test_missing_dir_is_a_results_error_and_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such run directory"):
        load_run(tmp_path / "nope")


def test_corrupt_line_names_file_and_line_number(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "r", extra_lines=('{"kind": "train", "step": 7, "lo',))
    with pytest.raises(ResultsError) as info:
        load_run(run_dir)
    # 6 train + 3 eval records come first, so the broken one is line 10.
    assert f"{run_dir / 'metrics.jsonl'}:10" in str(info.value)


def test_non_object_line_is_rejected(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "r", extra_lines=("[1, 2]",))
    with pytest.raises(ResultsError, match=r"metrics.jsonl:10: expected a JSON object"):
        load_run(run_dir)


# --------------------------------------------------------------------------- plotting


def test_plot_runs_writes_a_png(tmp_path: Path) -> None:
    b = make_run(tmp_path, "b", accuracies=(0.3, 0.4, 0.9), samples_per_s=300.0)  # a line of its own
    runs = [load_run(make_run(tmp_path, "a")), load_run(b)]
    out = plot_runs(runs, tmp_path / "plots" / "results.png")
    assert out == tmp_path / "plots" / "results.png"
    assert out.read_bytes().startswith(PNG_MAGIC)
    with Image.open(out) as image:
        assert image.size == (1500, 900)  # 15 x 9 inches at 100 dpi
        pixels = np.asarray(image.convert("RGB"), dtype=np.int16)
    # Not blank: each run's lines are drawn in its colour (C0 blue, C1 orange), beyond
    # the legend's ~60 pixels.
    for colour in ((31, 119, 180), (255, 127, 14)):
        near = (np.abs(pixels - np.array(colour)).max(axis=-1) <= 24).sum()
        assert near > 500, (colour, near)


def test_figure_has_six_panels_one_line_per_run_and_a_legend(tmp_path: Path) -> None:
    runs = [load_run(make_run(tmp_path, "baseline")), load_run(make_run(tmp_path, "fast"))]
    fig = build_figure(runs)
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == [
        "train loss",
        "eval accuracy",
        "throughput",
        "MFU",
        "learning rate",
        "input image size",
    ]
    for ax in panels:
        assert ax.get_xlabel() == "wall-clock s"
        assert [line.get_label() for line in ax.lines] == ["baseline", "fast"]
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["baseline", "fast"]
    # Accuracy and MFU are plotted in percent, image size as the height.
    assert list(panels[1].lines[0].get_ydata()) == pytest.approx([50.0, 70.0, 60.0])
    assert list(panels[3].lines[0].get_ydata()) == pytest.approx([40.0] * 6)
    assert set(panels[5].lines[0].get_ydata()) == {16, 32}


def test_figure_skips_missing_and_nan_values(tmp_path: Path) -> None:
    extra = (
        '{"kind": "train", "step": 7, "elapsed_s": 70.0, "loss": NaN, "lr": null}',
        '{"kind": "train", "step": 8, "elapsed_s": 80.0, "loss": 0.1}',
        '{"kind": "eval", "step": 8, "elapsed_s": 80.0}',
    )
    fig = build_figure([load_run(make_run(tmp_path, "r", extra_lines=extra))])
    loss, acc, _, mfu, lr, size = (ax for ax in fig.axes if ax.get_title())
    assert len(loss.lines[0].get_xdata()) == 7  # the NaN point is dropped, step 8 kept
    assert len(lr.lines[0].get_xdata()) == 6
    assert len(acc.lines[0].get_xdata()) == 3
    assert len(size.lines[0].get_xdata()) == 6
    assert len(mfu.lines[0].get_xdata()) == 6  # records without mfu are left out


def test_plot_without_runs_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ResultsError):
        plot_runs([], tmp_path / "x.png")


# --------------------------------------------------------------------------- comparing


def two_runs(tmp_path: Path) -> list:
    base = make_run(
        tmp_path, "baseline", accuracies=(0.5, 0.8, 0.75), wall_time_s=120.0, samples_per_s=400.0
    )
    fast = make_run(
        tmp_path,
        "fast",
        model="resnet50",
        algorithms=("channels_last", "mixed_precision"),
        accuracies=(0.6, 0.7),
        wall_time_s=40.0,
        samples_per_s=1234.5,
    )
    return [load_run(base), load_run(fast)]


def test_compare_runs_json_fields_and_speedup(tmp_path: Path) -> None:
    base, fast = compare_runs_json(two_runs(tmp_path))
    assert base["run"] == "baseline" and fast["run"] == "fast"
    assert fast["model"] == "resnet50"
    assert fast["algorithms"] == ["channels_last", "mixed_precision"]
    assert base["algorithms"] == []
    assert base["final_accuracy_pct"] == pytest.approx(75.0)
    assert base["best_accuracy_pct"] == pytest.approx(80.0)
    assert fast["final_accuracy_pct"] == pytest.approx(70.0)
    assert fast["wall_time_s"] == 40.0 and fast["samples_per_s"] == 1234.5
    assert base["speedup"] == pytest.approx(1.0)
    assert fast["speedup"] == pytest.approx(3.0)
    json.dumps([base, fast])  # scripts can dump it as is


def test_compare_runs_table(tmp_path: Path) -> None:
    table = compare_runs(two_runs(tmp_path))
    header, rule, base, fast = table.splitlines()
    for column in (
        "run",
        "model",
        "algorithms",
        "final acc %",
        "best acc %",
        "wall s",
        "samples/s",
        "speed-up",
    ):
        assert column in header
    assert base.split()[:2] == ["baseline", "resnet18"]
    assert "75.00" in base and "80.00" in base and "120.0" in base and "1.00x" in base
    assert "channels_last, mixed_precision" in fast
    assert "70.00" in fast and "40.0" in fast and "1234.5" in fast and "3.00x" in fast
    # Aligned: every right-aligned column ends at the same offset on every line.
    end = header.index("speed-up") + len("speed-up")
    assert base[end - 1] == "x" and fast[end - 1] == "x"


def test_compare_falls_back_to_metrics_without_summary(tmp_path: Path) -> None:
    base = load_run(make_run(tmp_path, "base", wall_time_s=60.0))
    crashed = load_run(make_run(tmp_path, "crashed", summary=False, algorithms=("ema",)))
    row = compare_runs_json([base, crashed])[1]
    assert row["final_accuracy_pct"] == pytest.approx(60.0)  # last eval record
    assert row["best_accuracy_pct"] == pytest.approx(70.0)
    assert row["wall_time_s"] == 60.0  # last elapsed_s seen
    assert row["speedup"] == pytest.approx(1.0)
    assert row["algorithms"] == ["ema"]  # from the config
    assert row["status"] is None
    assert "-" in compare_runs([base, crashed]).splitlines()[-1]


def test_compare_with_no_accuracy_shows_dashes(tmp_path: Path) -> None:
    run = load_run(make_run(tmp_path, "noeval", accuracies=()))
    row = compare_runs_json([run])[0]
    assert row["final_accuracy_pct"] is None and row["best_accuracy_pct"] is None
    table = compare_runs([run]).splitlines()
    assert table[2].split()[3:5] == ["-", "-"]
    assert table[-1] == "no time to accuracy: the first run has no evaluation; give --target (e.g. 0.6)"


def test_a_wall_time_speed_up_is_shown_only_between_runs_of_the_same_work(tmp_path: Path) -> None:
    base = make_run(tmp_path, "base", accuracies=(0.5, 0.8), eval_elapsed=(20.0, 40.0))
    half = make_run(tmp_path, "half", accuracies=(0.6,), eval_elapsed=(10.0,))
    for path, samples in ((base, 2048), (half, 1024)):
        summary = json.loads((path / "summary.json").read_text())
        (path / "summary.json").write_text(json.dumps({**summary, "samples": samples}))
    rows = compare_runs_json([load_run(base), load_run(half)])
    assert rows[1]["speedup"] is None and rows[1]["time_to_target_s"] is None  # 60 % < the 80 % target
    assert "only for runs that trained as many samples" in compare_runs([load_run(base), load_run(half)])


def test_a_run_without_a_summary_reads_its_rates_from_its_log(tmp_path: Path) -> None:
    from slipstream.run.results import _logged_rates

    # A warm-up interval of 2 steps at 70/s, then 14 steps at 450/s: 16 steps in 2/70 + 14/450.
    records = [{"step": 2, "samples_per_s": 70.0, "mfu": 0.01}, {"step": 16, "samples_per_s": 450.0, "mfu": 0.05}]
    rate, mfu = _logged_rates(records)
    first, rest = 2 / 70.0, 14 / 450.0
    assert rate == pytest.approx(16 / (first + rest))  # not the plain mean, 260
    assert mfu == pytest.approx((0.01 * first + 0.05 * rest) / (first + rest))


# --------------------------------------------------------------------------- time to accuracy


def test_compare_time_to_the_first_runs_final_accuracy(tmp_path: Path) -> None:
    # The baseline ends at 75 % (reached at 60 s); the fast run passes 75 % at its
    # second evaluation (12 s) and ends below it, which wall time alone would hide.
    base = make_run(tmp_path, "base", accuracies=(0.5, 0.8, 0.75), eval_elapsed=(20.0, 40.0, 60.0))
    fast = make_run(tmp_path, "fast", accuracies=(0.6, 0.76, 0.7), eval_elapsed=(6.0, 12.0, 18.0))
    slow = make_run(tmp_path, "never", accuracies=(0.1, 0.2), eval_elapsed=(5.0, 10.0))
    runs = [load_run(p) for p in (base, fast, slow)]
    rows = compare_runs_json(runs)
    assert [r["target_accuracy_pct"] for r in rows] == pytest.approx([75.0] * 3)
    # Reached at the first record >= 75 %: 40 s for the baseline (80 % > 75 %), not 60 s.
    assert [r["time_to_target_s"] for r in rows[:2]] == [40.0, 12.0]
    assert rows[1]["time_to_target_speedup"] == pytest.approx(40.0 / 12.0)
    assert rows[2]["time_to_target_s"] is None and rows[2]["time_to_target_speedup"] is None

    header, _, *lines = compare_runs(runs).splitlines()
    assert "time to 75.00 %" in header and "speed-up to 75.00 %" in header
    assert "12.0 s" in lines[1] and "3.33x" in lines[1]


def test_compare_with_a_chosen_target(tmp_path: Path) -> None:
    base = make_run(tmp_path, "base", accuracies=(0.5, 0.8, 0.75), eval_elapsed=(20.0, 40.0, 60.0))
    fast = make_run(tmp_path, "fast", accuracies=(0.6, 0.76, 0.7), eval_elapsed=(6.0, 12.0, 18.0))
    rows = compare_runs_json([load_run(base), load_run(fast)], target=0.6)
    assert [r["time_to_target_s"] for r in rows] == [40.0, 6.0]
    assert "time to 60.00 %" in compare_runs([load_run(base)], target=0.6)
    for bad in (60, 0, -0.5, 1.5):
        with pytest.raises(ResultsError, match=r"fraction in \(0, 1\]"):
            compare_runs_json([load_run(base)], target=bad)


def test_compare_shows_mfu_from_the_summary_or_the_records(tmp_path: Path) -> None:
    with_summary = make_run(tmp_path, "a", mfu=0.25)
    summary = json.loads((with_summary / "summary.json").read_text())
    (with_summary / "summary.json").write_text(json.dumps({**summary, "mfu": 0.5}))
    records_only = make_run(tmp_path, "b", mfu=0.25, summary=False)
    unknown = make_run(tmp_path, "c", mfu=None, summary=False)
    rows = compare_runs_json([load_run(p) for p in (with_summary, records_only, unknown)])
    assert [r["mfu"] for r in rows] == [0.5, 0.25, None]
    header, _, first, *_ = compare_runs([load_run(with_summary)]).splitlines()
    assert "MFU %" in header and "50.0" in first


def test_issue_44_case_12_the_loss_axis_is_logarithmic_so_a_diverged_run_flattens_no_other(tmp_path: Path) -> None:
    """Issue 44, case 12: `slipstream plot`'s loss axis was linear, so one run whose loss
    went to 1e4 drew every other run as a flat line at the bottom."""
    blown = tuple(
        json.dumps({"kind": "train", "step": 7 + i, "elapsed_s": 70.0 + i, "loss": 10.0 ** (i + 2)})
        for i in range(3)
    )
    runs = [load_run(make_run(tmp_path, "calm")), load_run(make_run(tmp_path, "diverged", extra_lines=blown))]
    loss = next(ax for ax in build_figure(runs).axes if ax.get_title() == "train loss")
    assert loss.get_yscale() == "log" and "log" in loss.get_ylabel()
    # A loss of the user's own that goes to 0 or below has no logarithm: symlog keeps it.
    below = (json.dumps({"kind": "train", "step": 7, "elapsed_s": 70.0, "loss": -1.0}),)
    loss = next(ax for ax in build_figure([load_run(make_run(tmp_path, "neg", extra_lines=below))]).axes
                if ax.get_title() == "train loss")
    assert loss.get_yscale() == "symlog"


def test_issue_44_plot_writes_through_the_atomic_path(tmp_path: Path, monkeypatch) -> None:
    """Issue 44: every write goes through the atomic, checked path; a plot that fails to
    be written leaves no half-written PNG, and an older one as it was."""
    import errno
    import os

    from slipstream.cli.main import user_error_message

    out = tmp_path / "plot.png"
    out.write_bytes(b"the older plot")

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("matplotlib.figure.Figure.savefig", full)
    with pytest.raises(OSError) as failed:
        plot_runs([load_run(make_run(tmp_path, "r"))], out)
    assert user_error_message(failed.value) == f"cannot use {out}: the disk is full"
    assert out.read_bytes() == b"the older plot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png", "r"]


def test_issue_44_compare_json_is_strict_json(tmp_path: Path, monkeypatch, capsys) -> None:
    """Issue 44: every JSON the engine writes is strict JSON: a non-finite value in
    `compare --json` is null, never a NaN or Infinity token."""
    from slipstream.cli.main import main

    monkeypatch.setattr(
        "slipstream.run.results.compare_runs_json", lambda runs, target: [{"run": "r", "speedup": float("inf")}]
    )
    assert main(["compare", str(make_run(tmp_path, "r")), "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in the JSON")) == [
        {"run": "r", "speedup": None}
    ]


def test_issue_44_compare_says_when_runs_trained_on_different_data(tmp_path: Path) -> None:
    """A 10-class synthetic run beside a 3-class ImageFolder run was compared with no note."""
    synthetic = make_run(tmp_path, "synthetic", data="name: synthetic\n  num_classes: 10\n")
    folder = make_run(tmp_path, "folder", data="name: imagefolder\n  root: /data/flowers\n")
    same = make_run(tmp_path, "same", data="name: synthetic\n  num_classes: 10\n")
    table = compare_runs([load_run(synthetic), load_run(folder)])
    assert table.splitlines()[-1] == ("note: these runs trained on different data, so their accuracies do not "
                                      "compare: synthetic: synthetic (10 classes); folder: imagefolder /data/flowers")
    assert "different data" not in compare_runs([load_run(synthetic), load_run(same)])
    assert compare_runs_json([load_run(folder)])[0]["data"] == "imagefolder /data/flowers"
