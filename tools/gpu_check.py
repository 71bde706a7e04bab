"""The Python steps of tools/gpu_check.sh (run them through that script).

    python3 tools/gpu_check.py prereq --wheels DIR [--dry-run]
    python3 tools/gpu_check.py site SITE
    python3 tools/gpu_check.py report --out OUT --work WORK [--dry-run]

``prereq`` checks what the device machine must have and prints one line: what is
there, or what is missing (exit 2). ``site`` installs the engine and every plugin of
this checkout into SITE without pip and without a network: the packages copied as
pip would lay them out, and a ``.dist-info`` per distribution so that entry points
(how the engine finds its plugins) and versions read as from a real install; it
needs only the standard library and runs in a second. ``report`` reads the CUDA
tests' JUnit XML and the pair's two run directories under WORK and writes
``gpu_check.json`` and ``gpu_check.txt`` to OUT.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# On the bare GPU machine's python3 already (its image's package list).
PROVIDED = ("torch", "torchvision", "timm", "pluggy", "pytest", "tqdm", "matplotlib", "yaml", "numpy", "PIL")
# Carried as wheels (`make gpu-wheels`): import name -> distribution name.
CARRIED = {
    "omegaconf": "omegaconf", "kornia": "kornia", "kornia_rs": "kornia_rs",
    "webdataset": "webdataset", "braceexpand": "braceexpand",
}  # fmt: skip
PAIR = ("baseline", "fast")


# -- prereq ---------------------------------------------------------------------------------------


def _wheel_names(wheels: Path) -> dict[str, Path]:
    """Distribution name (normalised) -> wheel file, for wheels this python can install."""
    try:
        from packaging.tags import sys_tags
        from packaging.utils import parse_wheel_filename
    except ImportError:  # no packaging: trust the file names
        return {p.name.split("-")[0].lower(): p for p in wheels.glob("*.whl")}
    supported = set(sys_tags())
    found = {}
    for path in sorted(wheels.glob("*.whl")):
        name, _, _, tags = parse_wheel_filename(path.name)
        if tags & supported:
            found[name.replace("-", "_")] = path
    return found


def prereq(wheels: Path, dry_run: bool) -> int:
    missing: list[str] = []
    if sys.version_info < (3, 11):  # tomllib, for the plugins' pyproject.toml
        missing.append(f"Python >= 3.11 (this is {platform.python_version()})")
    absent = [m for m in PROVIDED if importlib.util.find_spec(m) is None]
    if absent:
        missing.append("python packages " + ", ".join(absent) + " (the device image should have them)")
    carried = _wheel_names(wheels) if wheels.is_dir() else {}
    lacking = [
        dist for module, dist in CARRIED.items()
        if importlib.util.find_spec(module) is None and dist.lower() not in carried
    ]
    if lacking:
        missing.append(
            f"wheels for {', '.join(lacking)} in {wheels} (run `make gpu-wheels` on the CPU machine "
            "and carry the folder)"
        )
    if not (ROOT / "engine" / "slipstream").is_dir():
        missing.append(f"the engine's source in {ROOT / 'engine'}")
    device = "CPU (dry run)"
    if not missing and not dry_run:  # torch's import and CUDA's start take seconds: only here
        import torch

        if not torch.cuda.is_available():
            missing.append(f"a CUDA GPU (torch {torch.__version__} sees none)")
        else:
            device = torch.cuda.get_device_name()
    if missing:
        print("gpu_check: missing: " + "; ".join(missing), file=sys.stderr)
        return 2
    compiler = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    note = "" if compiler or dry_run else " (no C compiler on PATH: Triton and torch.compile will fail)"
    print(
        f"gpu_check: prerequisites ok: Python {platform.python_version()}, torch {version('torch')}, "
        f"{device}, {len(carried)} wheels for this Python in {wheels.name}{note}"
    )
    return 0


# -- site -----------------------------------------------------------------------------------------


def _toml(path: Path) -> dict[str, Any]:
    import tomllib

    return tomllib.loads(path.read_text(encoding="utf-8"))


def _copy(source: Path, target: Path) -> None:
    if source.is_dir():
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"), dirs_exist_ok=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


def _dist_info(site: Path, project: dict[str, Any], top_level: list[str]) -> None:
    name, version = project["name"], project["version"]
    info = site / f"{re.sub(r'[-_.]+', '_', name)}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    requires = "".join(f"Requires-Dist: {r}\n" for r in project.get("dependencies", []))
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: {project.get('description', '')}\n"
        + requires,
        encoding="utf-8",
    )
    groups = dict(project.get("entry-points", {}))
    if project.get("scripts"):
        groups["console_scripts"] = project["scripts"]
    lines = []
    for group, entries in groups.items():
        lines.append(f"[{group}]")
        lines.extend(f"{key} = {value}" for key, value in entries.items())
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines), encoding="utf-8")
    (info / "top_level.txt").write_text("\n".join(top_level) + "\n", encoding="utf-8")
    (info / "INSTALLER").write_text("slipstream-gpu-check\n", encoding="utf-8")


def _plugin_modules(folder: Path, config: dict[str, Any]) -> list[Path]:
    tool = config.get("tool", {}).get("setuptools", {})
    names = list(tool.get("py-modules", [])) + [p for p in tool.get("packages", []) if "." not in p]
    if not names:  # no explicit list: the folder's slipstream_* module or package
        names = [p.stem for p in folder.glob("slipstream_*.py")] + [
            p.name for p in folder.glob("slipstream_*") if (p / "__init__.py").is_file()
        ]
    paths = []
    for name in names:
        module, package = folder / f"{name}.py", folder / name
        paths.append(module if module.is_file() else package)
    return paths


def site(target: Path) -> int:
    target.mkdir(parents=True, exist_ok=True)
    engine = _toml(ROOT / "pyproject.toml")["project"]
    # setup.cfg's layout: the package under engine/, the recipes inside it.
    _copy(ROOT / "engine" / "slipstream", target / "slipstream")
    recipes = target / "slipstream" / "bundled_recipes"
    recipes.mkdir(exist_ok=True)
    for path in [*ROOT.glob("recipes/*.yaml"), ROOT / "recipes" / "__init__.py"]:
        _copy(path, recipes / path.name)
    _dist_info(target, engine, ["slipstream"])
    names = ["slipstream"]
    plugins = [*ROOT.glob("algorithms/*/pyproject.toml"), *ROOT.glob("callbacks/*/pyproject.toml")]
    for pyproject in sorted([*plugins, *ROOT.glob("datasets/*/pyproject.toml")]):  # webdataset: the pipeline step
        config = _toml(pyproject)
        modules = _plugin_modules(pyproject.parent, config)
        for path in modules:
            _copy(path, target / path.name)
        _dist_info(target, config["project"], [p.stem for p in modules])
        names.append(config["project"]["name"])
    print(f"gpu_check: installed {len(names)} distributions (engine and plugins, no dependencies) into {target}")
    return 0


def verify(target: Path, load: bool) -> int:
    """The engine imports from ``target`` and its entry points name every algorithm;
    with ``load``, each algorithm is imported too (seconds: torch, kornia)."""
    spec = importlib.util.find_spec("slipstream")
    origin = spec.origin if spec is not None else None
    if origin is None or not origin.startswith(str(target)):
        print(f"gpu_check: slipstream imports from {origin}, not from {target}", file=sys.stderr)
        return 1
    from slipstream.plugins.discovery import ALGORITHMS_GROUP, list_installed

    infos = list_installed(ALGORITHMS_GROUP, check=load)
    broken = [f"{i.name}: {i.error}" for i in infos if getattr(i, "error", None)]
    if broken:
        print("gpu_check: algorithms that do not load: " + "; ".join(broken), file=sys.stderr)
        return 1
    print(f"gpu_check: {len(infos)} algorithms load from {target}: {', '.join(i.name for i in infos)}")
    return 0


# -- report ---------------------------------------------------------------------------------------


def _tests_from_log(log: Path) -> dict[str, Any]:
    """The outcomes pytest -v printed before it was stopped (no XML is written then)."""
    cases = []
    text = log.read_text(errors="replace") if log.is_file() else ""
    for match in re.finditer(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)", text, re.MULTILINE):
        outcome = {"PASSED": "passed", "SKIPPED": "skipped"}.get(match.group(2), "failed")
        cases.append({"test": match.group(1).rsplit("/", 1)[-1], "outcome": outcome, "seconds": 0.0, "detail": ""})
    count = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "skipped")}
    return {"ran": bool(cases), "from_log": True, **count, "cases": cases}


def _tests(xml: Path) -> dict[str, Any]:
    if not xml.is_file():
        return _tests_from_log(xml.with_suffix(".log"))
    cases = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                detail = (node.get("message") or "").strip().splitlines()[0][:300] if node.get("message") else ""
                break
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        cases.append({"test": name, "outcome": outcome, "seconds": float(case.get("time", 0)), "detail": detail})
    count = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "skipped")}
    return {"ran": True, **count, "cases": cases}


def _pair(work: Path) -> dict[str, Any]:
    from slipstream.run.results import compare_runs_json, load_run

    loaded, rows = {}, {}
    for name in PAIR:
        try:
            loaded[name] = load_run(work / name)
        except Exception as exc:  # a run that never started or was cut off before its summary
            rows[name] = {"run": name, "error": f"{type(exc).__name__}: {exc}"}
    if len(loaded) == len(PAIR):
        # Time to the baseline's final accuracy, as `slipstream compare` reads it.
        for name, row in zip(PAIR, compare_runs_json(list(loaded.values())), strict=True):
            rows[name] = {**row, "time_to_baseline_final_s": row["time_to_target_s"]}
    else:  # one run alone (the other left out or failed): its own figures
        for name, run in loaded.items():
            rows[name] = compare_runs_json([run])[0]
    for name in PAIR:
        summary_path = work / name / "summary.json"
        if summary_path.is_file() and name in rows:
            summary = json.loads(summary_path.read_text())
            rows[name].update(
                {
                    key: summary.get(key)
                    for key in ("status", "device_name", "samples_per_s", "peak_tflops", "compute_dtype", "peak_dtype")
                }
            )
            rows[name]["compile_time_s"] = summary.get("compile_time_s")
    return rows


def _plain_loop(log: Path) -> list[str]:
    """The tables of ``bench_plain_loop.py`` (the log's lines from its first table on,
    without the step log's time stamps)."""
    if not log.is_file():
        return []
    stamp = re.compile(r"^\s*\d+\.\d  ")  # gpu_check.py stamp's "   12.3  " before each line
    lines = [stamp.sub("", line, count=1) for line in log.read_text().splitlines()]
    start = next((i for i, line in enumerate(lines) if line.startswith("hand-written loop")), None)
    return [] if start is None else lines[start:]


def _from(log: Path, first: str) -> list[str]:
    """A benchmark's lines from the first that holds ``first`` on, without the step
    log's time stamps (``bench_decode.py``'s rates, ``bench_pipeline.py``'s)."""
    if not log.is_file():
        return []
    stamp = re.compile(r"^\s*\d+\.\d  ")
    lines = [stamp.sub("", line, count=1) for line in log.read_text().splitlines()]
    start = next((i for i, line in enumerate(lines) if first in line), None)
    return [] if start is None else lines[start:]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


def report(out: Path, work: Path, dry_run: bool) -> int:
    out.mkdir(parents=True, exist_ok=True)
    device, cuda = "cpu", None
    if not dry_run:  # a second of torch's import and CUDA's start, for the device's name
        import torch

        cuda = torch.version.cuda
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    else:
        device = _cpu_model()
    steps = {}
    for line in (work / "steps.tsv").read_text().splitlines() if (work / "steps.tsv").is_file() else []:
        name, rc, seconds = line.split("\t")
        if rc == "skipped":
            steps[name] = {"exit": None, "seconds": 0.0, "timed_out": False, "left_out": True}
            continue
        steps[name] = {"exit": int(rc), "seconds": float(seconds), "timed_out": int(rc) in (124, 137)}
    tests = _tests(work / "cuda_tests.xml")
    pair = _pair(work)
    plain = _plain_loop(work / "plain_loop.log")
    decode = _from(work / "decode.log", "JPEGs of")
    pipeline = _from(work / "pipeline.log", "written as shards")
    result = {
        "dry_run": dry_run,
        "device": device,
        "torch": version("torch"),
        "cuda": cuda,
        "python": platform.python_version(),
        "steps": steps,
        "cuda_tests": tests,
        "pair": pair,
        "plain_loop": plain,
        "decode": decode,
        "pipeline": pipeline,
    }
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    lines = [
        f"gpu_check {'(dry run, CPU) ' if dry_run else ''}on {device}, torch {version('torch')} "
        f"(CUDA {cuda or '-'}), Python {platform.python_version()}",
        "",
        "steps:",
        *(
            f"  {name:<10} left out (GPU_CHECK_SKIP; the pair: GPU_CHECK_PAIR=1)"
            if s.get("left_out")
            else f"  {name:<10} exit {s['exit']:>3}  {s['seconds']:7.1f} s{'  TIMED OUT' if s['timed_out'] else ''}"
            for name, s in steps.items()
        ),
        "",
        f"CUDA tests: {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped",
        *(
            f"  {c['outcome']:<7} {c['seconds']:6.1f} s  {c['test']}" + (f"  -- {c['detail']}" if c["detail"] else "")
            for c in tests["cases"]
        ),
    ]
    left_out = all(steps.get(name, {}).get("left_out") for name in PAIR)
    lines += ["", "time-to-accuracy pair: left out (GPU_CHECK_PAIR=1 runs it)"] if left_out else [
        "",
        "time-to-accuracy pair (target: the baseline's final accuracy):",
        f"  {'run':<9} {'status':<12} {'final %':>8} {'wall s':>8} {'to target s':>11} {'img/s':>9} "
        f"{'MFU %':>6} {'peak MiB':>9} {'compile s':>9}",
    ]  # fmt: skip
    for name in [] if left_out else PAIR:
        row = pair.get(name, {"error": "no run"})
        if "error" in row:
            lines.append(f"  {name:<9} {row['error']}")
            continue

        def num(key: str, scale: float = 1.0, digits: int = 1, row: dict = row) -> str:
            value = row.get(key)
            return "-" if value is None else f"{value * scale:.{digits}f}"

        lines.append(
            f"  {name:<9} {str(row.get('status')):<12} {num('final_accuracy_pct'):>8} {num('wall_time_s'):>8} "
            f"{num('time_to_baseline_final_s'):>11} {num('samples_per_s', digits=0):>9} {num('mfu', 100):>6} "
            f"{num('peak_memory_mb', digits=0):>9} {num('compile_time_s'):>9}"
        )
    base, fast = pair.get("baseline", {}), pair.get("fast", {})
    if base.get("time_to_baseline_final_s") and fast.get("time_to_baseline_final_s"):
        speedup = base["time_to_baseline_final_s"] / fast["time_to_baseline_final_s"]
        lines.append(f"  fast reaches the baseline's final accuracy {speedup:.2f}x sooner")
    if plain:
        lines += ["", "the pair's network on random data on the device (benchmarks/bench_plain_loop.py):"]
        lines += [f"  {line}" for line in plain]
    if pipeline:
        lines += ["", "the input pipeline: training from JPEG shards against a batch on the device "
                      "(benchmarks/bench_pipeline.py):"]
        lines += [f"  {line}" for line in pipeline]
    if decode:
        lines += ["", "JPEG decoding, data.decode=gpu against cpu (benchmarks/bench_decode.py):"]
        lines += [f"  {line}" for line in decode]
    text = "\n".join(lines) + "\n"
    (out / "gpu_check.txt").write_text(text)
    print(text, end="")
    return 0


def train(args: list[str], dump_after: float) -> int:
    """``slipstream train ARGS`` that says in its log when ``main`` returned (the
    process should end right after), and writes every thread's stack there if it is
    still going after ``dump_after`` seconds: a run that has finished but does not
    exit shows where it waits."""
    import faulthandler

    faulthandler.dump_traceback_later(dump_after, exit=False)
    from slipstream.cli.main import main as slipstream_main

    code = slipstream_main(["train", *args])
    # The step's log stamps this line with its second: the process should end then.
    print(f"gpu_check: slipstream train returned {code}; the process exits now", file=sys.stderr, flush=True)
    return code


def stamp_lines() -> int:
    """Copy standard input to standard output, each line led by the seconds since start."""
    import time

    started = time.monotonic()
    for line in sys.stdin:
        sys.stdout.write(f"{time.monotonic() - started:7.1f}  {line}")
        sys.stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    # train [--dump-after S] SLIPSTREAM-TRAIN-ARGS...: the rest goes to slipstream as it is.
    p = sub.add_parser("train", allow_abbrev=False)
    p.add_argument("--dump-after", type=float, default=600.0, help="seconds before the stack dump")
    sub.add_parser("stamp")
    p = sub.add_parser("prereq")
    p.add_argument("--wheels", type=Path, required=True)
    p.add_argument("--dry-run", action="store_true")
    p = sub.add_parser("site")
    p.add_argument("target", type=Path)
    p = sub.add_parser("verify")
    p.add_argument("target", type=Path)
    p.add_argument("--no-load", action="store_true", help="find the plugins' modules, import none")
    p = sub.add_parser("report")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--dry-run", action="store_true")
    args, rest = parser.parse_known_args(argv)
    if args.command == "train":
        return train(rest, args.dump_after)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "stamp":
        return stamp_lines()
    if args.command == "prereq":
        return prereq(args.wheels, args.dry_run)
    if args.command == "site":
        return site(args.target)
    if args.command == "verify":
        return verify(args.target, load=not args.no_load)
    return report(args.out, args.work, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
