"""`make gpu-wheels`: download the wheels the bare GPU machine lacks into .gpu-wheels/.

The device machine's python3 (3.12, manylinux x86-64) has torch, torchvision, timm,
pluggy, pytest, tqdm, matplotlib, numpy, PyYAML and packaging, and no network. This
fetches, for that Python and platform, the wheels of what the engine and the plugins
the CUDA tests and the pipeline step use need beyond that (omegaconf, kornia, webdataset), at the versions installed in
this checkout's .venv (what the tests here ran with), and then what those need in
turn, read from each wheel's metadata. A dependency published only as a source
distribution is built here into a wheel with ``pip wheel`` (only pure-Python ones are
accepted). The folder is git-ignored; name it in the device call's ``carry``.

    .venv/bin/python tools/gpu_wheels.py [--dest .gpu-wheels] [--sweep]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parent.parent
LIMIT_MIB = 48  # the whole working tree travels in 64 MiB
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
# The device image's own packages (docs/gpu.md; /work/.library/device/KINDS.md lists them all).
ON_DEVICE = {
    canonicalize_name(n)
    for n in (
        "torch torchvision timm pluggy pytest pytest-xdist pytest-timeout tqdm matplotlib numpy pyyaml "
        "packaging pillow typing-extensions filelock fsspec jinja2 networkx sympy triton setuptools wheel "
        "huggingface-hub safetensors scipy pandas rich"
    ).split()
}
WANTED = ["omegaconf", "kornia", "webdataset"]  # webdataset: the pipeline step reads shards
SWEEP = ["optuna"]  # `slipstream sweep` only; no CUDA test needs it
# The device's interpreter, for evaluating the dependencies' environment markers.
DEVICE_ENV = {
    **default_environment(),
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}


def pinned(name: str) -> str:
    """``name==version`` as installed here, or the bare name."""
    try:
        return f"{name}=={metadata.version(name)}"
    except metadata.PackageNotFoundError:
        return name


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def fetch(requirement: str, dest: Path) -> Path:
    """The wheel of ``requirement`` for the device, downloaded (or built) into ``dest``."""
    before = set(dest.glob("*.whl"))
    platform_args = [arg for p in PLATFORMS for arg in ("--platform", p)]
    got = pip(
        "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation",
        "cp", *platform_args, "-d", str(dest), requirement,
    )
    if got.returncode != 0:  # no wheel for the device: a pure-Python sdist, built here
        with tempfile.TemporaryDirectory() as tmp:
            built = pip("wheel", "-q", "--no-deps", "--no-binary=:all:", "-w", tmp, requirement)
            if built.returncode != 0:
                raise SystemExit(f"gpu_wheels: no wheel for {requirement}: {got.stderr.strip()[-300:]}")
            for wheel in Path(tmp).glob("*.whl"):
                if not wheel.name.endswith("-none-any.whl"):
                    raise SystemExit(f"gpu_wheels: {requirement} builds {wheel.name}, not a pure-Python wheel")
                (dest / wheel.name).write_bytes(wheel.read_bytes())
    new = set(dest.glob("*.whl")) - before
    name = canonicalize_name(Requirement(requirement).name)
    match = [w for w in dest.glob("*.whl") if canonicalize_name(parse_wheel_filename(w.name)[0]) == name]
    if not match:
        raise SystemExit(f"gpu_wheels: {requirement}: nothing usable downloaded ({sorted(p.name for p in new)})")
    return sorted(match)[-1]


def requirements(wheel: Path) -> list[Requirement]:
    """The wheel's dependencies that apply on the device (no extras)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode("utf-8").splitlines()
    found = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate({**DEVICE_ENV, "extra": ""}):
                found.append(req)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=ROOT / ".gpu-wheels")
    parser.add_argument("--sweep", action="store_true", help="also optuna and its needs (`slipstream sweep`)")
    args = parser.parse_args()
    dest = args.dest
    dest.mkdir(parents=True, exist_ok=True)
    queue = [pinned(n) for n in WANTED + (SWEEP if args.sweep else [])]
    done: set[str] = set()
    while queue:
        requirement = queue.pop(0)
        name = canonicalize_name(re.split(r"[<>=!~ \[;]", requirement, maxsplit=1)[0])
        if name in done:
            continue
        done.add(name)
        wheel = fetch(requirement, dest)
        print(f"gpu_wheels: {wheel.name}")
        for req in requirements(wheel):
            dep = canonicalize_name(req.name)
            if dep not in ON_DEVICE and dep not in done:
                queue.append(pinned(req.name) if str(req.specifier) == "" or _installed_fits(req) else str(req))
    # One version of each: two would stop the device's install.
    by_name: dict[str, list[str]] = {}
    for wheel in dest.glob("*.whl"):
        by_name.setdefault(canonicalize_name(parse_wheel_filename(wheel.name)[0]), []).append(wheel.name)
    twice = {n: v for n, v in by_name.items() if len(v) > 1}
    if twice:
        raise SystemExit(f"gpu_wheels: more than one version in {dest}: {twice}; delete the folder and run again")
    total = sum(w.stat().st_size for w in dest.glob("*.whl")) / 2**20
    if total > LIMIT_MIB:
        raise SystemExit(f"gpu_wheels: {total:.1f} MiB of wheels in {dest}, over {LIMIT_MIB} MiB (64 in all travel)")
    print(f"gpu_wheels: {len(by_name)} wheels, {total:.1f} MiB in {dest} (carry the folder to the device)")


def _installed_fits(req: Requirement) -> bool:
    try:
        return req.specifier.contains(metadata.version(req.name), prereleases=True)
    except metadata.PackageNotFoundError:
        return False


if __name__ == "__main__":
    main()
