"""The command line: a thin layer over the Python API.

slipstream train [--recipe NAME_OR_PATH] [--algorithms a,b,no:c] [--callbacks a,no:b] [key=value ...]
                 [--nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P]]
slipstream algorithms [--json] [--check]
slipstream callbacks [--json] [--check]
slipstream datasets [--json] [--check]
slipstream metrics [--json] [--check]
slipstream data convert imagefolder DIR --to webdataset OUT [--shard-size 256MB]
slipstream data index URLS [URLS ...] -o FILE [--overwrite]
slipstream recipes [--json]
slipstream sweep --recipe R --trials N [--sweep-dir D] [--metric accuracy] [--direction maximize]
                 key=loguniform(a,b) key=uniform(a,b) key=int(a,b) key=choice(x,y) [key=value ...]
slipstream eval --checkpoint PATH [--recipe R] [--ema | --weights W] [--metrics a,b] [--set NAME] [--model M]
                [-o F] [key=value ...]
slipstream export --checkpoint PATH --format torchscript|onnx|exported-program -o FILE [--ema] [key=value ...]
slipstream average RUN_DIR --last N | --best N -o FILE [--overwrite]
slipstream plot RUN_DIR [RUN_DIR ...] [-o runs.png]
slipstream compare RUN_DIR [RUN_DIR ...] [--target 0.6] [--json]
slipstream compatibility [--out PATH] [--check] [--algorithms a,b] [--add FILE.py:Class]
                         [--together a,b,c] [--set algorithms.NAME.KEY=VALUE] [--no-distributed]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slipstream.errors import (
    ConfigError,
    ConfigWarning,
    DataError,
    ResultsError,
    SlipstreamError,
    describe,
    describe_os_error,
    network_failure,
)

EXIT_USAGE = 2
EXIT_FAILED = 1
EXIT_DIVERGED = 3


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"slipstream: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _add_listing(sub: Any, kind: str, item: str) -> None:
    """``slipstream algorithms`` and ``slipstream callbacks``: one listing, two groups."""
    listing = sub.add_parser(kind, help=f"list installed {kind}")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.add_argument(
        "--check",
        action="store_true",
        help=f"import every {item} and report the ones that fail to load (slower)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="slipstream",
        description="Train vision models with speed-up techniques as plugins.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    # The order here is the order `slipstream --help` lists the commands in.
    _add_train(sub)
    _add_listing(sub, "algorithms", "plugin")
    _add_sweep(sub)
    _add_listing(sub, "callbacks", "callback")
    _add_listing(sub, "datasets", "dataset")
    _add_listing(sub, "metrics", "metric")
    _add_data(sub)
    _add_eval(sub)
    _add_export(sub)
    _add_average(sub)
    _add_recipes(sub)
    _add_plot(sub)
    _add_compare(sub)
    _add_compatibility(sub)
    return parser


def _add_train(sub: Any) -> None:
    train = sub.add_parser(
        "train",
        help="train a model (the default recipe unless --recipe is given)",
        description="Train. Merge order: defaults < recipe < --algorithms/--callbacks < key=value overrides.",
    )
    train.add_argument(
        "--recipe",
        "-r",
        default=None,
        help="a bundled recipe name or a YAML path (default: 'default')",
    )
    train.add_argument(
        "--algorithms",
        "-a",
        default=None,
        action=_Joined,
        help="comma-separated algorithms to add; 'no:NAME' removes one (given twice, both count)",
    )
    train.add_argument(
        "--callbacks",
        default=None,
        action=_Joined,
        help="comma-separated callbacks to add (loggers, profiler, early stopping); "
        "'no:NAME' removes one (given twice, both count)",
    )
    train.add_argument(
        "--quiet", "-q", action="store_true", help="no progress bar or summary table"
    )
    launch = train.add_argument_group(
        "several processes (torch.distributed.run's elastic agent; without these, one "
        "process, or whatever torchrun started)"
    )
    launch.add_argument(
        "--nproc-per-node", type=int, default=None, metavar="N", help="processes on this machine"
    )
    launch.add_argument("--nnodes", type=int, default=1, metavar="M", help="machines (default 1)")
    launch.add_argument(
        "--node-rank", type=int, default=0, metavar="R", help="this machine's index, 0 to M-1"
    )
    launch.add_argument(
        "--master-addr", default=None, metavar="A", help="host of node 0 (needed when M > 1)"
    )
    launch.add_argument(
        "--master-port", type=int, default=None, metavar="P", help="a free TCP port on node 0"
    )
    train.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides, e.g. trainer.max_duration=5ep",
    )


def _add_sweep(sub: Any) -> None:
    sweep = sub.add_parser(
        "sweep",
        help="hyper-parameter search over a recipe (optuna: seeded TPE, median pruning)",
        description="Search hyper-parameters with optuna. Each trial is a run in SWEEP_DIR/trial-NNN; "
        "the study lives in SWEEP_DIR/study.db, so running the same command again continues it. "
        "Writes SWEEP_DIR/trials.csv and SWEEP_DIR/best.yaml (train it with --recipe).",
    )
    sweep.add_argument("--recipe", "-r", default=None, help="a bundled recipe name or a YAML path (default: 'default')")
    sweep.add_argument("--trials", "-n", type=int, required=True, help="finished trials the sweep should hold")
    sweep.add_argument("--sweep-dir", "-d", default=None, help="default: runs/sweep-<recipe>-<date>-<time>")
    sweep.add_argument("--metric", default="accuracy", help="an evaluated metric: accuracy, loss, f1_macro, ...")
    sweep.add_argument(
        "--direction", default=None, choices=("maximize", "minimize"), help="default: the metric's own"
    )
    sweep.add_argument(
        "--pruner-startup-trials",
        type=int,
        default=2,
        metavar="N",
        help="finished trials before the median pruner prunes (default 2)",
    )
    sweep.add_argument(
        "space",
        nargs="*",
        metavar="key=FORM",
        help="key=loguniform(a,b), key=uniform(a,b), key=int(a,b), key=choice(x,y,...), or a fixed key=value",
    )


def _add_data(sub: Any) -> None:
    data = sub.add_parser("data", help="data tools: convert an ImageFolder tree to shards, index shards")
    data_sub = data.add_subparsers(dest="data_command", metavar="ACTION", parser_class=_Parser)
    convert = data_sub.add_parser(
        "convert",
        help="write an ImageFolder tree (DIR/train/<class>/*, DIR/val/<class>/*) as shards",
        description="slipstream data convert imagefolder DIR --to webdataset OUT [--shard-size 256MB]",
    )
    convert.add_argument("source", choices=["imagefolder"], help="the format of DIR")
    convert.add_argument("src", metavar="DIR")
    convert.add_argument("--to", required=True, metavar="FORMAT", help="the shard format: webdataset")
    convert.add_argument("out", metavar="OUT", help="the folder the shards are written to")
    convert.add_argument("--shard-size", default="256MB", help="bytes per shard: 256MB, 1GB, 500KB (default 256MB)")
    convert.add_argument("--no-progress", action="store_true", help="no progress bar")
    index = data_sub.add_parser(
        "index",
        help="write the index of existing WebDataset shards (their sample counts), for data.index",
        description="slipstream data index URLS [URLS ...] -o FILE [--overwrite]: count the samples of "
        "the shards URLS name (as data.urls: brace patterns, globs, pipe: commands) and write their "
        "index to FILE; a run given data.index=FILE reads no shard before its first batch.",
    )
    index.add_argument("urls", nargs="+", metavar="URLS", help="shards, as data.urls takes them")
    index.add_argument("--output", "-o", required=True, metavar="FILE", help="the index file to write")
    index.add_argument("--overwrite", action="store_true", help="replace an existing FILE")


def _add_checkpoint_options(command: argparse.ArgumentParser) -> None:
    """What ``slipstream eval`` and ``slipstream export`` share: the checkpoint, the
    recipe on top of its config, which weights, and key=value overrides."""
    command.add_argument("--checkpoint", "-c", required=True, help="a checkpoint file or a run directory")
    command.add_argument("--recipe", "-r", default=None, help="a recipe on top of the checkpoint's config")
    command.add_argument(
        "--weights",
        default="model",
        help="which weights: model (default) or one a plugin keeps in the checkpoint, e.g. ema",
    )
    command.add_argument("--ema", action="store_true", help="the EMA weights (same as --weights ema)")
    command.add_argument(
        "--model",
        default=None,
        metavar="package.module:build",
        help="the function that builds the model (called with num_classes), for a checkpoint of a Trainer "
        "built in Python around a model of your own (same as model.name=...)",
    )
    command.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. data.val_size=500"
    )


def _add_eval(sub: Any) -> None:
    evaluate = sub.add_parser(
        "eval",
        help="evaluate a checkpoint; prints the metrics as JSON and writes them",
        description="Evaluate a checkpoint on its run's eval data, or on what --recipe and "
        "key=value overrides give (e.g. data.name=cifar10 data.root=...). Prints the metrics "
        "as JSON and writes them to -o (default: eval.json beside the checkpoint's run).",
    )
    _add_checkpoint_options(evaluate)
    evaluate.add_argument(
        "--metrics",
        default=None,
        action=_Joined,
        help="comma-separated metrics (slipstream metrics; or package.module:Class), instead of the run's "
        "evaluation.metrics",
    )
    evaluate.add_argument(
        "--set",
        default=None,
        metavar="NAME",
        help="evaluate only this set of data.eval_sets (default: every set; a run without eval_sets has one, val)",
    )
    evaluate.add_argument("--output", "-o", default=None, help="the metrics JSON file")
    evaluate.add_argument("--overwrite", action="store_true", help="replace an existing --output file")


def _add_export(sub: Any) -> None:
    export = sub.add_parser(
        "export",
        help="export a checkpoint's model for inference (checked against the eager model)",
        description="Write the checkpoint's model as TorchScript (a trace), ONNX or a "
        "torch.export ExportedProgram, with each plugin's model surgery kept or undone as the "
        "plugin declares, and check the file's outputs against the eager model on a batch. "
        "The model takes normalised inputs; the mean and std are printed.",
    )
    _add_checkpoint_options(export)
    export.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    export.add_argument("--format", "-f", required=True, choices=("torchscript", "onnx", "exported-program"))
    export.add_argument("--output", "-o", required=True, help="the file to write")
    export.add_argument("--no-check", action="store_true", help="skip the comparison with the eager model")


def _add_average(sub: Any) -> None:
    average = sub.add_parser(
        "average",
        help="average the weights of a run's last or best N checkpoints into one checkpoint",
        description="Average the weights of N checkpoints of a run (timm's avg_checkpoints): the N most "
        "recent (--last; keep them with trainer.checkpoint_keep >= N) or the N best by the run's "
        "trainer.best_metric (--best; keep them with trainer.keep_best=N). Every set of weights is "
        "averaged (the model's, and ema's where the run has it); the file evaluates and exports like "
        "any checkpoint (slipstream eval/export --checkpoint FILE [--ema]).",
    )
    average.add_argument("run", metavar="RUN_DIR", help="the run directory whose checkpoints are averaged")
    which = average.add_mutually_exclusive_group(required=True)
    which.add_argument("--last", type=int, metavar="N", help="the N most recent checkpoints")
    which.add_argument("--best", type=int, metavar="N", help="the N best checkpoints by trainer.best_metric")
    average.add_argument("--output", "-o", required=True, help="the checkpoint file to write")
    average.add_argument("--overwrite", action="store_true", help="replace an existing --output file")


def _add_recipes(sub: Any) -> None:
    recipes = sub.add_parser("recipes", help="list bundled recipes")
    recipes.add_argument("--json", action="store_true", help="machine-readable output")


def _add_plot(sub: Any) -> None:
    plot = sub.add_parser("plot", help="plot loss, accuracy, throughput, LR and image size of runs")
    plot.add_argument("runs", nargs="+", metavar="RUN_DIR")
    plot.add_argument(
        "--output",
        "-o",
        default=None,
        help="PNG path (default: RUN_DIR/plot.png for one run, runs.png otherwise)",
    )


def _add_compare(sub: Any) -> None:
    compare = sub.add_parser(
        "compare", help="side-by-side table of runs (the first is the baseline)"
    )
    compare.add_argument("runs", nargs="+", metavar="RUN_DIR")
    compare.add_argument(
        "--target",
        type=float,
        default=None,
        metavar="ACC",
        help="accuracy (a fraction, e.g. 0.6) for the time-to-accuracy columns "
        "(default: the first run's final accuracy)",
    )
    compare.add_argument("--json", action="store_true", help="machine-readable output")


def _add_compatibility(sub: Any) -> None:
    compat = sub.add_parser(
        "compatibility",
        help="train every installed algorithm alone, in pairs, with each optimizer and wrap; "
        "write the table (docs/compatibility.md)",
    )
    compat.add_argument("--out", type=Path, default=None, help="write the table here (default: print it)")
    compat.add_argument(
        "--check", action="store_true", help="compare with --out instead of writing it; exit 1 if it differs"
    )
    compat.add_argument("--algorithms", default=None, help="comma-separated names (default: all installed)")
    compat.add_argument(
        "--add", action="append", default=[], metavar="FILE.py:Class",
        help="also an algorithm that is not installed (a plugin's own checkout)",
    )
    compat.add_argument("--together", default="", help="comma-separated algorithms also trained all at once")
    compat.add_argument(
        "--set", action="append", default=[], dest="settings", metavar="algorithms.NAME.KEY=VALUE",
        help="an option for the short runs (recorded in the table)",
    )
    compat.add_argument(
        "--no-distributed", action="store_true", help="leave out the 2-process DDP and fsdp runs"
    )


def console() -> None:
    """The ``slipstream`` command (and ``python -m slipstream``): :func:`main`, then a
    quicker exit.

    At exit the interpreter's last garbage collections walk every object still alive,
    and torch, torchvision and timm keep hundreds of thousands: 1.2 s after each command
    here, more than most of them take. So the command's own garbage is collected now
    (finalizers run as they would have) and what is left is frozen out of those walks
    (``gc.freeze``). Everything else about the exit stays: ``atexit`` handlers (a
    logger's upload), the join of non-daemon threads, objects freed as modules are
    cleared. Only an object left in a reference cycle that outlives the command keeps
    its finalizer unrun, as CPython already allows at exit.
    """
    code = main()
    gc.collect()
    gc.freeze()
    sys.exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    # Options and key=value overrides may come in any order: argparse gives the
    # overrides after the first option back as extras, which join the others in order.
    args, extras = parser.parse_known_args(argv)
    takes_pairs = args.command in ("train", "sweep", "eval", "export")
    unknown = [e for e in extras if not takes_pairs or e.startswith("-") or "=" not in e]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extras and args.command == "sweep":
        args.space = [*args.space, *extras]
    elif extras:
        args.overrides = [*args.overrides, *extras]
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    with warnings.catch_warnings():
        warnings.simplefilter("always", ConfigWarning)
        warnings.showwarning = _show_warning(warnings.showwarning)
        from slipstream.plugins.discovery import discovered_once

        try:
            with discovered_once():  # each plugin group read once per command
                return _COMMANDS[args.command](args)
        except KeyboardInterrupt as exc:
            print(f"slipstream: {str(exc) or 'interrupted'}", file=sys.stderr)
            return 128 + getattr(exc, "signum", signal.SIGINT)
        except BrokenPipeError:
            # The reader of the output went away (`slipstream algorithms | head -1`):
            # nothing to report. Python's own flush at exit would complain, so stdout
            # goes to /dev/null first.
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):  # no file descriptor behind stdout
                pass
            return 0
        except Exception as exc:
            message = user_error_message(exc)
            if message is None:
                raise  # a bug: its traceback is what a report needs
            return _fail(message)


class _Joined(argparse.Action):
    """A comma-separated list option given more than once: the lists join (argparse
    would keep only the last, dropping the others without a word)."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option: Any = None) -> None:
        before = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, f"{before},{values}" if before else values)


def user_error_message(exc: BaseException) -> str | None:
    """The one-line message for an error a user can act on, or None for a bug."""
    if isinstance(exc, (DataError, ResultsError)):
        # Their text may come from a loader's worker, with that worker's traceback in it.
        return describe(exc)
    if isinstance(exc, SlipstreamError):
        return str(exc)
    if network_failure(exc) is not None:
        return (
            f"there is no network ({describe(network_failure(exc))}); "
            "offline, use data already on disk and model.pretrained=false"
        )
    if isinstance(exc, OSError):
        return describe_os_error(exc)
    return None


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    # Under torchrun every rank meets the same user error: one message (rank 0),
    # and every rank leaves the process group and exits with the same code.
    if _rank() == 0:
        print(f"slipstream: error: {message}", file=sys.stderr)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # leaving is best effort: the error above is what matters
        pass
    return code


def _show_warning(default: Any) -> Any:
    """Slipstream's own warnings as one line each (rank 0 only): config warnings, those
    raised in the engine's package or a plugin's module (``slipstream_<name>.py``), those
    whose message says ``slipstream:`` and those a plugin's hook raises (which point into
    pluggy, the plugin's caller: a path there would tell the user nothing); others (a
    library's) as Python shows them, naming the file that raised them."""
    package = str(Path(__file__).resolve().parents[1]) + os.sep  # slipstream/, not slipstream/cli/

    def show(message: Any, category: type, filename: str, *args: Any, **kwargs: Any) -> None:
        ours = (
            issubclass(category, ConfigWarning)
            or str(message).startswith("slipstream: ")
            or (category is UserWarning and str(Path(filename).resolve()).startswith(package))
            or (issubclass(category, UserWarning) and "pluggy" in Path(filename).parts)
            # A plugin's own module (slipstream_<name>.py), its warning raised where it is
            or (issubclass(category, UserWarning) and Path(filename).name.startswith("slipstream_"))
        )
        if not ours:
            default(message, category, filename, *args, **kwargs)
        elif _rank() == 0:
            # Warnings meant for the Python API name themselves; one prefix is enough here.
            text = str(message).removeprefix("slipstream: ")
            print(f"slipstream: warning: {text}", file=sys.stderr)

    return show


def _train(args: argparse.Namespace) -> int:
    from slipstream.config.recipes import DEFAULT_RECIPE
    from slipstream.config.schema import build_run

    recipe = args.recipe or DEFAULT_RECIPE
    quiet = ["trainer.progress_bar=false"] if args.quiet else []
    spec = build_run(recipe, args.algorithms, [*args.overrides, *quiet], callbacks=args.callbacks)
    if args.nproc_per_node is not None:
        return _launch(args, spec.config)
    if args.nnodes != 1 or args.node_rank or args.master_addr or args.master_port:
        raise ConfigError(
            "--nnodes, --node-rank, --master-addr and --master-port go with --nproc-per-node N"
        )
    # The config and its plugins are checked before torchvision and timm are imported
    # (3-4 s here): a misspelled key, algorithm or option is told without waiting for them.
    from slipstream.plugins.registry import Registry

    registry = Registry()
    plugins = _plugins(spec.config, registry)
    from slipstream.run.build import build_trainer

    trainer = build_trainer(spec, label=Path(recipe).stem, verbose=not args.quiet, installed=registry, plugins=plugins)
    try:
        summary = trainer.fit()
    except Exception as exc:
        message = user_error_message(exc)
        if message is None or not trainer.summary_writer.started:
            raise  # a bug, or a start that failed before the run began: exit 2
        # The run began and ended `failed` (a full disk, a file-size limit, unreadable
        # data mid-run): one line, and the exit code of that status.
        return _fail(message, EXIT_FAILED)
    if trainer.state.rank == 0:
        if not args.quiet:
            print(format_summary(summary))
        elif summary.get("stop_reason"):  # the trainer said it already when not quiet
            print(f"slipstream: {summary['stop_reason']}", file=sys.stderr)
    return exit_code(summary)


def _plugins(cfg: Any, registry: Any) -> tuple[list[Any], list[Any]]:
    """The run's algorithms and callbacks, built and checked (imports only those named)."""
    from slipstream.config.schema import to_dict
    from slipstream.plugins.discovery import CALLBACKS_GROUP

    return registry.build(to_dict(cfg.algorithms)), registry.build(to_dict(cfg.callbacks), CALLBACKS_GROUP)


def _launch(args: argparse.Namespace, cfg: Any) -> int:
    """Validate what the workers would build, then start them (torch.distributed.run)."""
    from slipstream.cli.launch import LaunchOptions, launch
    from slipstream.plugins.registry import Registry

    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        raise ConfigError(
            "--nproc-per-node inside a process that torchrun started: drop it, torchrun "
            "already launched the processes"
        )
    options = LaunchOptions(
        args.nproc_per_node, args.nnodes, args.node_rank, args.master_addr, args.master_port
    ).validate()
    registry = Registry()
    algorithms, callbacks = _plugins(cfg, registry)
    registry.run_plugins(algorithms, callbacks)  # ordered and checked as the workers will
    passed = [*(["--recipe", args.recipe] if args.recipe else [])]
    passed += ["--algorithms", args.algorithms] if args.algorithms else []
    passed += ["--callbacks", args.callbacks] if args.callbacks else []
    passed += ["--quiet"] if args.quiet else []
    return launch(options, [*passed, *args.overrides])


def exit_code(summary: dict[str, Any]) -> int:
    """The process exit code for a run's summary: 0 for a run that ended as asked
    (completed, target_reached, stopped_early), 128 + the signal for an interrupted
    one (130 for SIGINT, 143 for SIGTERM), 3 for diverged, 1 for failed."""
    status = summary.get("status")
    if status == "interrupted":
        name = summary.get("interrupted_by", "SIGINT")
        return 128 + getattr(signal.Signals, name, signal.SIGINT)
    if status == "diverged":
        return EXIT_DIVERGED
    if status == "failed":
        return EXIT_FAILED
    return 0


def _rate(value: Any) -> str:
    # None: a run finished by a resume that trained nothing, its rates unknown
    return f"{value:.0f} samples/s" if isinstance(value, (int, float)) else "- (not known)"


def format_summary(summary: dict[str, Any]) -> str:
    def pct(value: Any) -> str:
        return f"{100 * value:.2f} %" if isinstance(value, (int, float)) else "-"

    rows = [
        ("status", summary.get("status", "-")),
        ("accuracy", pct(summary.get("accuracy"))),
        ("best accuracy", pct(summary.get("best_accuracy"))),
        ("wall time", f"{summary.get('wall_time_s', 0):.1f} s"),
        ("throughput", _rate(summary.get("samples_per_s"))),
        ("epochs / batches", f"{summary.get('epochs')} / {summary.get('batches')}"),
        ("algorithms", ", ".join(a["name"] for a in summary.get("algorithms", [])) or "none"),
        ("callbacks", ", ".join(c["name"] for c in summary.get("callbacks", [])) or "none"),
        ("device", f"{summary.get('device')} x {summary.get('world_size', 1)}"),
        ("run directory", summary.get("run_dir", "-")),
    ]
    width = max(len(key) for key, _ in rows)
    line = "-" * (width + 40)
    body = "\n".join(f"{key:<{width}}  {value}" for key, value in rows)
    return f"{line}\n{body}\n{line}"


def _algorithms(args: argparse.Namespace) -> int:
    from slipstream.plugins.discovery import ALGORITHMS_GROUP

    return print_plugin_listing(ALGORITHMS_GROUP, "algorithms", check=args.check, as_json=args.json)


def _callbacks(args: argparse.Namespace) -> int:
    from slipstream.plugins.discovery import CALLBACKS_GROUP

    return print_plugin_listing(CALLBACKS_GROUP, "callbacks", check=args.check, as_json=args.json)


def print_plugin_listing(group: str, kind: str, *, check: bool, as_json: bool, infos: list[Any] | None = None) -> int:
    """Print the plugins of entry-point ``group`` (``kind`` names them: "algorithms").

    From the distributions' metadata, importing no plugin unless ``check``: the
    listing then costs a fraction of ``import torch``.
    """
    from slipstream.plugins.discovery import list_installed

    if infos is None:
        infos = list_installed(group, check=check)
    # A check that found a plugin which cannot load fails, so a script or CI job sees it.
    broken = [i.name for i in infos if i.error]
    failed = 1 if check and broken else 0
    if as_json:
        print(json.dumps([info.as_dict() for info in infos], indent=2))
        return failed
    if not infos:
        print(f"no {kind} installed (entry point group {group!r})")
        return 0
    rows = [
        (i.name, i.distribution, i.version, f"FAILED TO LOAD: {i.error}" if i.error else i.summary)
        for i in infos
    ]
    widths = [
        max(len(r[c]) for r in rows + [("name", "distribution", "version", "")]) for c in range(3)
    ]
    print(
        f"{'name':<{widths[0]}}  {'distribution':<{widths[1]}}  {'version':<{widths[2]}}  summary"
    )
    for row in rows:
        print(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:<{widths[2]}}  {row[3]}")
    if not check:
        print(f"(plugins not imported; `slipstream {kind} --check` imports each and reports load errors)")
    elif broken:
        print(f"slipstream: {len(broken)} of the {kind} failed to load: {', '.join(broken)}", file=sys.stderr)
    return failed


def _sweep(args: argparse.Namespace) -> int:
    from slipstream.config.recipes import DEFAULT_RECIPE
    from slipstream.errors import ConfigError
    from slipstream.run.directory import new_run_dir

    try:
        from slipstream.cli.sweep import run_sweep
    except ImportError as exc:
        raise ConfigError(
            f"slipstream sweep needs optuna ({exc}); install it with: pip install 'slipstream[sweep]'"
        ) from None
    recipe = args.recipe or DEFAULT_RECIPE
    sweep_dir = args.sweep_dir or new_run_dir(f"sweep-{Path(recipe).stem}")
    result = run_sweep(
        recipe,
        args.trials,
        sweep_dir,
        args.space,
        metric=args.metric,
        direction=args.direction,
        pruner_startup_trials=args.pruner_startup_trials,
    )
    if result.short:  # the sweep did not do what was asked (and best.yaml may be missing)
        return EXIT_FAILED
    return 0


def _weights(args: argparse.Namespace) -> str:
    if args.ema and args.weights not in ("model", "ema"):
        raise ConfigError(f"--ema and --weights {args.weights} choose different weights; give one")
    return "ema" if args.ema else args.weights


def _with_model(args: argparse.Namespace) -> list[str]:
    """The overrides, with ``--model`` as ``model.name`` (after them: the flag says it)."""
    return [*args.overrides, *([f"model.name={args.model}"] if args.model else [])]


def _default_eval_output(checkpoint: Path) -> Path:
    """eval.json (eval-ema.json, ...) in the run directory of ``checkpoint``."""
    run = checkpoint if checkpoint.is_dir() else checkpoint.parent
    if run.name == "checkpoints":
        run = run.parent
    return run


def _check_output(args: argparse.Namespace) -> None:
    """A given ``-o`` replaces no file this command did not make, unless ``--overwrite``
    says so, and never the checkpoint it reads; refused in one line before any work."""
    if args.output is None:
        return
    from slipstream.run.directory import RunDir

    output, checkpoint = Path(args.output), Path(args.checkpoint)
    if output.is_dir():
        raise ConfigError(f"-o {output} is a directory; give the file to write")
    if not output.exists():
        return
    read = RunDir(checkpoint).latest if checkpoint.is_dir() else checkpoint
    if read.exists() and output.samefile(read):
        raise ConfigError(f"-o {output} is the checkpoint being read; give another file")
    if not args.overwrite:
        raise ConfigError(f"-o {output} exists; give --overwrite to replace it, or another file")


def _eval(args: argparse.Namespace) -> int:
    from slipstream.run.inference import evaluate_checkpoint

    _check_output(args)
    weights = _weights(args)
    checkpoint = Path(args.checkpoint)
    output = args.output
    if output is None:
        name = "eval.json" if weights == "model" else f"eval-{weights}.json"
        name = name if args.set is None else name.replace(".json", f"-{args.set}.json")
        output = _default_eval_output(checkpoint) / name
    metrics = evaluate_checkpoint(
        checkpoint,
        recipe=args.recipe,
        overrides=_with_model(args),
        weights=weights,
        metrics=[m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics else None,
        eval_set=args.set,
    )
    from slipstream.run.directory import strict_json

    text = strict_json(metrics, indent=2)  # a NaN loss is null, named under "nonfinite": never a NaN token
    print(text, flush=True)  # first: a file that cannot be written loses nothing
    from slipstream.run.directory import atomic_write_text

    try:
        atomic_write_text(output, text + "\n")
    except (OSError, SlipstreamError) as exc:
        if args.output is not None:
            raise
        print(
            f"slipstream: warning: the metrics (above) are not written to {output}: {describe(exc)}; "
            "give -o FILE to write them elsewhere",
            file=sys.stderr,
        )
        return 0
    print(f"slipstream: metrics written to {output}", file=sys.stderr)
    return 0


def _export(args: argparse.Namespace) -> int:
    from slipstream.run.inference import export_checkpoint

    _check_output(args)
    result = export_checkpoint(
        Path(args.checkpoint),
        args.format,
        Path(args.output),
        recipe=args.recipe,
        overrides=_with_model(args),
        weights=_weights(args),
        check=not args.no_check,
    )
    from slipstream.run.directory import strict_json

    print(strict_json(result, indent=2))
    return 0


def _average(args: argparse.Namespace) -> int:
    from slipstream.run.average import average_run
    from slipstream.run.directory import strict_json

    result = average_run(args.run, args.output, last=args.last, best=args.best, overwrite=args.overwrite)
    print(strict_json(result, indent=2))
    steps = ", ".join(str(s["step"]) for s in result["sources"])
    print(
        f"slipstream: averaged the {' and '.join(result['weights'])} weights of {result['count']} checkpoints "
        f"(steps {steps}) into {result['file']}",
        file=sys.stderr,
    )
    return 0


def _recipes(args: argparse.Namespace) -> int:
    from slipstream.config.recipes import bundled, description

    recipes = bundled()
    if args.json:
        print(
            json.dumps(
                [
                    {"name": n, "path": str(p), "description": description(p)}
                    for n, p in recipes.items()
                ],
                indent=2,
            )
        )
        return 0
    width = max((len(n) for n in recipes), default=4)
    for name, path in recipes.items():
        print(f"{name:<{width}}  {description(path)}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from slipstream.run.results import load_run, plot_runs

    runs = [load_run(Path(p)) for p in args.runs]
    out = args.output or (Path(args.runs[0]) / "plot.png" if len(runs) == 1 else Path("runs.png"))
    print(plot_runs(runs, Path(out)))
    return 0


def _compare(args: argparse.Namespace) -> int:
    from slipstream.run.results import compare_runs, compare_runs_json, load_run

    runs = [load_run(Path(p)) for p in args.runs]
    if args.json:
        from slipstream.run.directory import finite_json

        # Strict JSON: a value no run gives a finite number for (a NaN loss) is null.
        print(json.dumps(finite_json(compare_runs_json(runs, args.target))[0], indent=2, allow_nan=False))
    else:
        print(compare_runs(runs, args.target))
    return 0


def _metrics(args: argparse.Namespace) -> int:
    from slipstream.plugins.metric import METRICS_GROUP, listed_metrics

    return print_plugin_listing(
        METRICS_GROUP, "metrics", check=args.check, as_json=args.json, infos=listed_metrics(check=args.check)
    )


def _datasets(args: argparse.Namespace) -> int:
    from slipstream.data.sources import DATASETS_GROUP

    return print_plugin_listing(DATASETS_GROUP, "datasets", check=args.check, as_json=args.json)


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """``256MB`` -> bytes (KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024)."""
    import re

    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _SIZE_UNITS or float(match.group(1)) <= 0:
        raise ConfigError(f"--shard-size {text!r}: give a positive size like 256MB, 1GB or 500KB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def _data(args: argparse.Namespace) -> int:
    from slipstream.data.sources import dataset_class

    if args.data_command == "index":
        return _data_index(args)
    if args.data_command != "convert":
        print("slipstream: error: say what to do: slipstream data convert ... | index ...", file=sys.stderr)
        return EXIT_USAGE
    shard_size = parse_size(args.shard_size)
    try:
        cls = dataset_class(args.to)
    except ConfigError as exc:
        raise ConfigError(f"--to {args.to}: {exc}") from None
    writer = getattr(cls, "convert", None)
    if writer is None:
        raise ConfigError(f"--to {args.to}: the dataset plugin {args.to!r} cannot write shards (it has no convert)")
    src, out = (os.path.expanduser(p) for p in (args.src, args.out))  # '~/data', quoted
    result = writer(args.source, src, out, shard_size=shard_size, progress=not args.no_progress)
    for split, count in result.get("samples", {}).items():
        skipped = result.get("skipped", {}).get(split)
        note = f" ({skipped} unreadable left out)" if skipped else ""
        print(f"{split}: {count} images in {result['shards'][split]} shards{note}")
    keys = " ".join(f"'data.{k}={result[k]}'" for k in ("urls", "eval_urls") if k in result)
    print(f"train on them with: slipstream train data.name={args.to} {keys}")
    if "index" in result:
        print(f"their index (sample counts; found beside them, or give data.index=): {result['index']}")
    return 0


def _data_index(args: argparse.Namespace) -> int:
    """``slipstream data index``: refuses an existing -o without --overwrite, before any shard is read."""
    from slipstream.data.sources import dataset_class

    output = os.path.expanduser(args.output)
    if os.path.isdir(output):
        raise ConfigError(f"-o {output} is a directory; give the file to write, e.g. {output}/index.json")
    if os.path.exists(output) and not args.overwrite:
        raise ConfigError(f"-o {output} exists; give --overwrite to replace it, or another file")
    cls = dataset_class("webdataset")
    result = cls.index([os.path.expanduser(u) for u in args.urls], output)
    written = result["index"]
    print(f"{written}: {result['shards']} shards, {result['samples']} samples; give data.index={written}")
    return 0


def _compatibility(args: argparse.Namespace) -> int:
    from slipstream.cli.compatibility import compatibility_command

    return compatibility_command(
        out=args.out,
        check=args.check,
        algorithms=args.algorithms,
        add=args.add,
        together=args.together,
        settings=args.settings,
        distributed=not args.no_distributed,
    )


_COMMANDS = {
    "train": _train,
    "datasets": _datasets,
    "metrics": _metrics,
    "data": _data,
    "algorithms": _algorithms,
    "callbacks": _callbacks,
    "recipes": _recipes,
    "sweep": _sweep,
    "eval": _eval,
    "export": _export,
    "average": _average,
    "plot": _plot,
    "compare": _compare,
    "compatibility": _compatibility,
}
