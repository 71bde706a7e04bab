"""Read run directories and turn them into plots and comparison tables.

Pure functions over files on disk: the CLI parses arguments and calls these, so
scripts and notebooks can use them the same way.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from slipstream.data.sources import data_locations
from slipstream.errors import ResultsError
from slipstream.run import directory as rundir

__all__ = [
    "ResultsError",
    "Run",
    "build_figure",
    "compare_runs",
    "compare_runs_json",
    "load_run",
    "plot_runs",
    "time_to_accuracy",
]

# The run-directory contract owns the names; these aliases keep older imports working.
METRICS_FILE = rundir.METRICS
SUMMARY_FILE = rundir.SUMMARY


@dataclass
class Run:
    path: Path
    name: str
    config: dict[str, Any] = field(default_factory=dict)
    train: list[dict[str, Any]] = field(default_factory=list)
    eval: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None


# --------------------------------------------------------------------------- loading


def load_run(run_dir: str | Path) -> Run:
    """Load one run directory written by the engine.

    A run that crashed early may have metrics but no summary, or a summary but no
    metrics, so either file is enough; the config is optional for the same reason.
    """
    path = Path(run_dir)
    if not path.exists():
        raise ResultsError(f"{path}: no such run directory")
    if not path.is_dir():
        raise ResultsError(f"{path}: expected a run directory, got a file")
    paths = rundir.RunDir(path)
    metrics_path, summary_path = paths.metrics, paths.summary
    if not metrics_path.is_file() and not summary_path.is_file():
        raise ResultsError(_not_a_run_message(path))

    train: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    if metrics_path.is_file():
        for record in _read_jsonl(metrics_path):
            # Unknown kinds are skipped so newer engines can log more without
            # breaking older readers.
            if record.get("kind") == "train":
                train.append(record)
            elif record.get("kind") == "eval":
                evals.append(record)

    summary = _read_summary(summary_path) if summary_path.is_file() else None
    config = _read_config(paths.config)
    return Run(path=path, name=path.name, config=config, train=train, eval=evals, summary=summary)


def _not_a_run_message(path: Path) -> str:
    message = f"{path} is not a run directory: expected {METRICS_FILE} and/or {SUMMARY_FILE} in it"
    # Users often pass the parent of their runs; point them at the real ones.
    children = sorted(
        p.name
        for p in path.iterdir()
        if p.is_dir() and (rundir.RunDir(p).metrics.is_file() or rundir.RunDir(p).summary.is_file())
    )
    if children:
        shown = ", ".join(children[:5]) + (", ..." if len(children) > 5 else "")
        message += f" (it contains {len(children)} run directories: {shown})"
    return message


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ResultsError(f"{path}:{lineno}: corrupt JSON line: {e.msg}") from e
            if not isinstance(record, dict):
                raise ResultsError(
                    f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}"
                )
            records.append(record)
    return records


def _read_summary(path: Path) -> dict[str, Any]:
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ResultsError(f"{path}:{e.lineno}: corrupt JSON: {e.msg}") from e
    if not isinstance(summary, dict):
        raise ResultsError(f"{path}: expected a JSON object, got {type(summary).__name__}")
    return summary


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    # Imported here so that reading metrics does not need omegaconf's import cost.
    from omegaconf import OmegaConf

    try:
        config = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as e:  # omegaconf and yaml raise many unrelated types
        raise ResultsError(f"{path}: unreadable config: {e}") from e
    if not isinstance(config, dict):
        raise ResultsError(f"{path}: expected a mapping at the top level")
    return config


# --------------------------------------------------------------------------- values


def _number(value: Any) -> float | None:
    """A finite float, or None for anything missing, NaN, infinite or non-numeric."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _image_height(record: dict[str, Any]) -> float | None:
    size = record.get("image_size")
    if isinstance(size, (list, tuple)):
        size = size[0] if size else None
    return _number(size)


def _dig(mapping: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if not isinstance(mapping, dict):
            return None
        mapping = mapping.get(key)
    return mapping


# --------------------------------------------------------------------------- plotting

# (title, y label, which records, how to read y from a record, draw as steps)
_PANELS: list[tuple[str, str, str, Callable[[dict[str, Any]], float | None], bool]] = [
    ("train loss", "loss", "train", lambda r: _number(r.get("loss")), False),
    (
        "eval accuracy",
        "accuracy (%)",
        "eval",
        lambda r: None if (a := _number(r.get("accuracy"))) is None else 100.0 * a,
        False,
    ),
    ("throughput", "samples/s", "train", lambda r: _number(r.get("samples_per_s")), False),
    (
        "MFU",
        "MFU (%)",
        "train",
        lambda r: None if (m := _number(r.get("mfu"))) is None else 100.0 * m,
        False,
    ),
    ("learning rate", "lr", "train", lambda r: _number(r.get("lr")), False),
    # Image size changes in jumps; steps show when a change took effect.
    ("input image size", "height (px)", "train", _image_height, True),
]

X_LABEL = "wall-clock s"


def build_figure(runs: Sequence[Run]) -> Figure:
    """The results figure: one panel per metric, one line per run, against wall clock.

    Built on a bare Figure rather than pyplot so no window or global state is involved.
    """
    if not runs:
        raise ResultsError("no runs to plot")
    fig = Figure(figsize=(15, 9), layout="constrained")
    FigureCanvasAgg(fig)
    panel_axes = fig.subplots(2, 3).flatten()
    for ax, (title, ylabel, kind, getter, steps) in zip(panel_axes, _PANELS, strict=True):
        for i, run in enumerate(runs):
            # The eval panel draws each further evaluation set of a run too, dashed.
            for n, prefix in enumerate(["", *(f"{s}/" for s in eval_set_names(run))] if kind == "eval" else [""]):
                xs, ys = [], []
                for record in run.train if kind == "train" else run.eval:
                    if prefix:  # the set's metrics under their bare names, the record's time kept
                        record = {**record, **{k[len(prefix) :]: v for k, v in record.items() if k.startswith(prefix)}}
                    x, y = _number(record.get("elapsed_s")), getter(record)
                    if x is not None and y is not None:
                        xs.append(x)
                        ys.append(y)
                if xs:
                    # Fixed colour per run so a run is the same colour in every panel,
                    # even when it has no data in some of them.
                    ax.plot(
                        xs,
                        ys,
                        color=f"C{i % 10}",
                        label=run.name + (f" {prefix[:-1]}" if prefix else ""),
                        marker="o" if len(xs) < 30 else None,
                        markersize=3,
                        linestyle=("-", "--", ":", "-.")[n % 4],
                        drawstyle="steps-post" if steps else "default",
                    )
        if kind == "eval" and any(eval_set_names(run) for run in runs):
            ax.legend(fontsize="small")  # which line is which evaluation set
        if not ax.lines:
            ax.text(
                0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="grey"
            )
        # A run that diverged or failed says so where its lines would be.
        marks = [f"{run.name}: {_status(run)}" for run in runs if _status(run) in NO_RESULT]
        if marks:
            ax.text(
                0.02, 0.02, "\n".join(marks), transform=ax.transAxes, ha="left", va="bottom", color="C3"
            )
        ax.set_title(title)
        ax.set_xlabel(X_LABEL)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    # Learning rates like 4e-4 are unreadable as plain decimals.
    panel_axes[4].ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
    _log_scale_for_loss(panel_axes[0])

    # Below the panels, so it is not squeezed over any data.
    handles = [
        Line2D([], [], color=f"C{i % 10}", label=_legend_label(run)) for i, run in enumerate(runs)
    ]
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncols=min(len(runs), 4),
        title="runs",
        frameon=False,
    )
    return fig


def _log_scale_for_loss(ax: Any) -> None:
    """The loss on a log scale: one run that diverged (a loss of 1e4) on a linear axis
    flattens every other run's curve into a line at the bottom. A loss of 0 or less (a
    loss of the user's own) has no logarithm: symlog, linear around 0, keeps it."""
    values = [y for line in ax.lines for y in line.get_ydata()]
    if not values:
        return
    if min(values) > 0:
        ax.set_yscale("log")
        ax.set_ylabel("loss (log scale)")
    else:
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_ylabel("loss (symlog scale)")


def _status(run: Run) -> str | None:
    return (run.summary or {}).get("status")


def _legend_label(run: Run) -> str:
    status = _status(run)
    return run.name if status in (None, "completed") else f"{run.name} ({status})"


def plot_runs(runs: Sequence[Run], out_path: str | Path) -> Path:
    """Write the results figure for `runs` as a PNG at `out_path` and return the path."""
    out = Path(out_path)
    figure = build_figure(runs)
    # Atomic: a failed write (a full disk) leaves no half-written PNG, and says so in one line.
    rundir.atomic_write(out, lambda f: figure.savefig(f, format="png", dpi=100))
    return out


# --------------------------------------------------------------------------- comparing


def compare_runs_json(runs: Sequence[Run], target: float | None = None) -> list[dict[str, Any]]:
    """One dict per run with the comparison fields; the first run is the baseline.

    Time to accuracy: ``time_to_target_s`` is the ``elapsed_s`` of a run's first eval
    record that reaches ``target`` (a fraction; by default the first run's final
    accuracy), so it works for any run, whether it was given a target or not.
    Accuracies are in percent, MFU a fraction; a value that cannot be known is None.
    """
    if target is not None:
        valid = isinstance(target, (int, float)) and not isinstance(target, bool)
        if not valid or not 0 < target <= 1:
            raise ResultsError(
                f"the target accuracy must be a fraction in (0, 1] (0.6 for 60 %), got {target!r}"
            )
    rows = [_row(run) for run in runs]
    if target is None and rows and rows[0]["final_accuracy_pct"] is not None:
        target = rows[0]["final_accuracy_pct"] / 100.0
    for run, row in zip(runs, rows, strict=True):
        row["target_accuracy_pct"] = None if target is None else 100.0 * target
        reached = None if target is None or row["status"] in NO_RESULT else time_to_accuracy(run, target)
        row["time_to_target_s"] = reached
    if rows:
        base = rows[0]
        for row in rows:
            # A run that diverged (or failed) trained nothing worth a speed-up: its
            # status says what happened, no figure stands for it.
            failed = row["status"] in NO_RESULT or base["status"] in NO_RESULT
            # A wall-time ratio says how much sooner only between runs of the same work.
            other_work = None not in (row["samples"], base["samples"]) and row["samples"] != base["samples"]
            row["speedup"] = None if failed or other_work else _ratio(base["wall_time_s"], row["wall_time_s"])
            row["time_to_target_speedup"] = _ratio(
                base["time_to_target_s"], row["time_to_target_s"]
            )
    return rows


# Statuses of runs whose final weights measure nothing: compare gives them no
# accuracy or speed-up, plot marks them.
NO_RESULT = ("diverged", "failed")


def time_to_accuracy(run: Run, target: float) -> float | None:
    """``elapsed_s`` of the first eval record of ``run`` with accuracy >= ``target``
    (a fraction); None if the run never reached it."""
    for record in run.eval:
        accuracy, elapsed = _number(record.get("accuracy")), _number(record.get("elapsed_s"))
        # The tolerance absorbs the float round trip of "the first run's final accuracy".
        if accuracy is not None and elapsed is not None and accuracy >= target - 1e-9:
            return elapsed
    return None


def eval_set_names(run: Run) -> list[str]:
    """The evaluation sets of ``run`` after the first (whose metrics have bare keys), in
    the order its eval records give them: the prefixes of their ``SET/METRIC`` keys."""
    names: dict[str, None] = {}
    for record in run.eval:
        for key in record:
            if "/" in key:
                names.setdefault(key.rpartition("/")[0], None)
    return list(names)


def _set_columns(run: Run) -> dict[str, float | None]:
    """Each further evaluation set's final and best accuracy (%), as ``SET/final_accuracy_pct``
    and ``SET/best_accuracy_pct``: summary.json's ``eval_sets``, else the eval records."""
    out: dict[str, float | None] = {}
    sets = (run.summary or {}).get("eval_sets") or {}
    for name in eval_set_names(run):
        found = [a for r in run.eval if (a := _number(r.get(f"{name}/accuracy"))) is not None]
        final = _number(_dig(sets, name, "final", "accuracy")) if name in sets else (found[-1] if found else None)
        best = max(found) if found else final
        out[f"{name}/final_accuracy_pct"] = None if final is None else 100.0 * final
        out[f"{name}/best_accuracy_pct"] = None if best is None else 100.0 * best
    return out


def _ratio(base: float | None, value: float | None) -> float | None:
    return base / value if base and value else None


def _row(run: Run) -> dict[str, Any]:
    summary = run.summary or {}
    accuracies = [a for r in run.eval if (a := _number(r.get("accuracy"))) is not None]

    # The summary is authoritative; the metrics log fills in for runs that died
    # before writing one.
    final = _number(summary.get("accuracy"))
    if final is None and accuracies and summary.get("status") not in NO_RESULT:
        final = accuracies[-1]
    best = max(accuracies) if accuracies else final
    if summary.get("status") in NO_RESULT:
        final = best = None

    wall = _number(summary.get("wall_time_s"))
    if wall is None:
        elapsed = [
            e for r in run.train + run.eval if (e := _number(r.get("elapsed_s"))) is not None
        ]
        wall = max(elapsed) if elapsed else None

    throughput = _number(summary.get("samples_per_s"))
    mfu = _number(summary.get("mfu"))
    if throughput is None or mfu is None:  # a run that died or runs on: its log fills in
        logged_rate, logged_mfu = _logged_rates(run.train)
        throughput = logged_rate if throughput is None else throughput
        mfu = logged_mfu if mfu is None else mfu

    return {
        "run": run.name,
        "model": _dig(run.config, "model", "name") or summary.get("model"),
        "algorithms": _algorithm_names(run),
        "final_accuracy_pct": None if final is None else 100.0 * final,
        "best_accuracy_pct": None if best is None else 100.0 * best,
        "wall_time_s": wall,
        "samples_per_s": throughput,
        "mfu": mfu,
        "peak_memory_mb": _number(summary.get("peak_memory_mb")),
        "samples": _number(summary.get("samples")),
        "status": summary.get("status"),
        "path": str(run.path),
        "data": data_of(run),
        **_set_columns(run),  # a run of several evaluation sets: each further set's accuracies
    }


def data_of(run: Run) -> str | None:
    """What a run trained on, as far as its config says: the dataset, where it is (its
    plugin's ``locations``) and the number of classes (None: no config)."""
    data = (run.config or {}).get("data") or {}
    if not data.get("name"):
        return None
    parts = [str(data["name"])]
    parts += [str(data[key]) for key in (k.split(".", 1)[1] for k in data_locations(run.config)) if data.get(key)]
    classes = _dig(run.config, "model", "num_classes") or data.get("num_classes")
    return " ".join(parts) + (f" ({classes} classes)" if classes else "")


def _logged_rates(records: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """The run's samples/s and MFU from its train records, as summary.json would give
    them: each record's rate holds for its own steps, so the run's is their total over
    the time they took (a plain mean of the rates weighs a short warm-up interval as
    much as the rest of the run, and read twice the true rate)."""
    steps = seconds = flop_seconds = mfu_seconds = 0.0
    last = 0.0
    for record in records:
        step, rate, mfu = (_number(record.get(k)) for k in ("step", "samples_per_s", "mfu"))
        if step is None or rate is None or rate <= 0 or step <= last:
            continue
        taken = (step - last) / rate  # in the time unit of one sample per step; the ratio is what counts
        steps += step - last
        seconds += taken
        if mfu is not None:
            flop_seconds += mfu * taken
            mfu_seconds += taken
        last = step
    if not seconds:
        return None, None
    return steps / seconds, (flop_seconds / mfu_seconds if mfu_seconds else None)


def _algorithm_names(run: Run) -> list[str]:
    # The summary has the resolved order; the config only has the requested set.
    entries = (run.summary or {}).get("algorithms")
    if isinstance(entries, list):
        names = [e.get("name") if isinstance(e, dict) else e for e in entries]
        return [str(n) for n in names if n]
    section = run.config.get("algorithms")
    return [str(name) for name in section] if isinstance(section, dict) else []


_COLUMNS: list[tuple[str, str, Callable[[Any], str]]] = [
    # (header, field, formatter); numeric columns are right-aligned.
    ("run", "run", str),
    ("model", "model", str),
    ("algorithms", "algorithms", lambda names: ", ".join(names) or "none"),
    ("final acc %", "final_accuracy_pct", lambda v: f"{v:.2f}"),
    ("best acc %", "best_accuracy_pct", lambda v: f"{v:.2f}"),
    ("wall s", "wall_time_s", lambda v: f"{v:.1f}"),
    ("samples/s", "samples_per_s", lambda v: f"{v:.1f}"),
    ("MFU %", "mfu", lambda v: f"{100 * v:.1f}"),
    ("speed-up", "speedup", lambda v: f"{v:.2f}x"),
    # "{target}" is replaced by the target accuracy of the comparison.
    ("time to {target}", "time_to_target_s", lambda v: f"{v:.1f} s"),
    ("speed-up to {target}", "time_to_target_speedup", lambda v: f"{v:.2f}x"),
    ("status", "status", str),
]
_LEFT_ALIGNED = {"run", "model", "algorithms", "status"}


def compare_runs(runs: Sequence[Run], target: float | None = None) -> str:
    """A plain-text table of `runs`, one row each; speed-ups are relative to the
    first, on wall time and on time to ``target`` accuracy (default: the first
    run's final accuracy)."""
    rows = compare_runs_json(runs, target)
    pct = rows[0]["target_accuracy_pct"] if rows else None
    label = "-" if pct is None else f"{pct:.2f} %"
    columns = list(_COLUMNS)
    # Each further evaluation set of any run: its final and best accuracy, after the first set's.
    sets = list(dict.fromkeys(name for run in runs for name in eval_set_names(run)))
    at = next(i for i, (_, key, _) in enumerate(columns) if key == "best_accuracy_pct") + 1
    columns[at:at] = [
        (f"{name} {which} %", f"{name}/{which}_accuracy_pct", lambda v: f"{v:.2f}")
        for name in sets
        for which in ("final", "best")
    ]
    cells = [[header.format(target=label) for header, _, _ in columns]]
    for row in rows:
        cells.append([("-" if row.get(key) is None else fmt(row[key])) for _, key, fmt in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]

    def render(line: list[str]) -> str:
        parts = [
            text.ljust(w) if key in _LEFT_ALIGNED else text.rjust(w)
            for text, w, (_, key, _) in zip(line, widths, columns, strict=True)
        ]
        return "  ".join(parts).rstrip()

    lines = [render(cells[0]), "  ".join("-" * w for w in widths)]
    lines += [render(line) for line in cells[1:]]
    if any(row["speedup"] is None and row["status"] not in NO_RESULT for row in rows[1:]):
        lines.append("speed-up: the first run's wall time over this one's, only for runs that trained as "
                     "many samples; a run of other length compares by time to accuracy")
    if pct is None:
        lines.append("no time to accuracy: the first run has no evaluation; give --target (e.g. 0.6)")
    trained_on = {row["data"] for row in rows if row["data"] is not None}
    if len(trained_on) > 1:  # accuracies on other data, other classes: no comparison
        lines.append("note: these runs trained on different data, so their accuracies do not compare: "
                     + "; ".join(f"{row['run']}: {row['data']}" for row in rows if row["data"] is not None))
    return "\n".join(lines)
