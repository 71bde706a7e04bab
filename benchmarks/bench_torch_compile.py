"""torch_compile: ResNet-18 at 32 px in fp32, eager vs compiled (Inductor), through the
real Trainer in one process. Compile time is reported apart from the steady-state
step time: the compiling steps fall in the untimed warm-up, and the plugin's own
estimate (compiling steps minus a typical step) is printed per repetition. The first
repetition compiles cold (fresh Inductor cache, in a temporary directory); later ones
are warm (Inductor's on-disk FX-graph and AOTAutograd caches, as on a restart).

(b) --curriculum: a 16-batch run whose image size grows from 48 to 64 px with the
image_size_curriculum plugin: eager, compiled with the image size marked dynamic
(the plugin's default with a curriculum) and compiled with torch's own automatic
dynamic shapes; each compiled run starts cold. Prints compiles, compile time, wall time.

    .venv/bin/python benchmarks/bench_torch_compile.py            # minutes: 1 cold, 2 warm compiles
    .venv/bin/python benchmarks/bench_torch_compile.py --with-channels-last-bf16
    .venv/bin/python benchmarks/bench_torch_compile.py --curriculum
    .venv/bin/python benchmarks/bench_torch_compile.py --quick         # aot_eager, seconds
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from slipstream_channels_last import ChannelsLast
from slipstream_torch_compile import TorchCompile, TorchCompileConfig
from torch._inductor.utils import clear_caches

from common import compare, parser, random_loader, report
from slipstream import Algorithm, Trainer, hookimpl
from slipstream.models import build_model
from slipstream.plugins.discovery import discover, plugin_config


def start_compiler(cold: bool) -> None:
    """Forget compiled code; when ``cold``, also every Inductor cache (memory and disk)."""
    torch._dynamo.reset()
    if cold:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_inductor_")
        clear_caches()


def installed(name: str, options: dict[str, Any]) -> Callable[[], Algorithm] | None:
    info = discover().get(name)
    if info is None or info.cls is None:
        print(f"({name} is not installed: its variants are skipped)")
        return None
    return lambda: info.cls(plugin_config(info.cls, options))


def step_ratio(args: Any) -> None:
    model_name, size, batch = ("test_resnet", 16, 8) if args.quick else ("resnet18", 32, 64)
    compilers: dict[str, list[TorchCompile]] = {}

    def variant(name: str, compiled: bool, *extra: Callable[[], Algorithm]):
        def build():
            torch.manual_seed(0)
            model = build_model(model_name, 10, image_size=size)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            algorithms = [make() for make in extra]
            if compiled:
                runs = compilers.setdefault(name, [])
                start_compiler(cold=not runs)
                runs.append(TorchCompile(TorchCompileConfig(backend=args.backend)))
                algorithms.append(runs[-1])
            return model, optimizer, algorithms

        return build

    variants = {"eager fp32": variant("eager fp32", False)}
    variants[f"compiled fp32 ({args.backend})"] = variant(f"compiled fp32 ({args.backend})", True)
    bf16 = installed("mixed_precision", {"dtype": "bf16"}) if args.with_channels_last_bf16 else None
    if bf16 is not None:
        variants["eager channels_last+bf16"] = variant("eager cl+bf16", False, ChannelsLast, bf16)
        name = f"compiled channels_last+bf16 ({args.backend})"
        variants[name] = variant(name, True, ChannelsLast, bf16)
    data = random_loader(batch * (args.warmup + args.steps), size, batch)
    results = compare(variants, data, steps=args.steps, warmup=args.warmup, repeats=args.repeats)
    report(
        f"(a) {model_name} at {size} px, batch {batch}, {args.threads} threads: "
        f"steady-state step time ({args.warmup} warm-up steps untimed)",
        results,
    )
    print("compile time (s), estimated by the plugin: first repetition cold, then warm")
    for name, runs in compilers.items():
        times = [r.stats["train_s"] + r.stats["eval_s"] for r in runs]
        warm = f", warm {statistics.median(times[1:]):.1f}" if len(times) > 1 else ""
        print(f"  {name:<44} cold {times[0]:.1f}{warm}  (compiles per run: "
              f"{[r.stats['compiles'] for r in runs]})")  # fmt: skip


def curriculum(args: Any) -> None:
    make_curriculum = installed(
        "image_size_curriculum", {"initial_scale": 0.75, "delay": 0.25, "finetune": 0.25}
    )
    if make_curriculum is None:
        return
    size, batch, batches = (32, 8, 8) if args.quick else (64, 16, 16)
    model_name = "test_resnet" if args.quick else "resnet18"
    data = random_loader(batch * batches, size, batch)
    print(f"(b) {model_name}, {batches} batches of {batch}, curriculum "
          f"{int(size * 0.75)} -> {size} px, {args.threads} threads")  # fmt: skip
    header = f"{'variant':<34} {'wall s':>7} {'compile s':>9} {'compiles':>8} {'last 4 ms':>9}"
    print("  " + header)
    options: dict[str, dict[str, Any] | None] = {
        "eager": None,
        "compiled, size marked dynamic": {"dynamic_image_size": True},
        "compiled, torch automatic dynamic": {"dynamic_image_size": False},
        "compiled, static (dynamic=false)": {"dynamic": False},
    }
    chosen = args.variants.split(",") if args.variants else list(options)
    for name, option in options.items():
        if not any(c in name for c in chosen):
            continue
        torch.manual_seed(0)
        model = build_model(model_name, 10, image_size=size)
        algorithms: list[Algorithm] = [make_curriculum()]
        compiler = None
        if option is not None:
            start_compiler(cold=True)
            compiler = TorchCompile(TorchCompileConfig(backend=args.backend, **option))
            algorithms.append(compiler)
        step_times = _StepTimes()
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(
                model=model,
                optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                train_data=data,
                max_duration=f"{batches}ba",
                algorithms=[*algorithms, step_times],
                run_dir=Path(tmp) / "run",
                device="cpu",
                eval_interval=None,
                checkpoint_interval=None,
                progress_bar=False,
                verbose=False,
            )
            summary = trainer.fit()
        stats = compiler.stats if compiler else {"compiles": 0}
        last = 1000 * statistics.median(step_times.times[-4:])
        compile_s = summary.get("compile_time_s", 0.0)
        print(f"  {name:<34} {summary['wall_time_s']:>7.1f} {compile_s:>9.1f} "
              f"{stats['compiles']:>8} {last:>9.1f}")  # fmt: skip


class _StepTimes(Algorithm):
    name = "bench_step_times"

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    @hookimpl(tryfirst=True)
    def batch_start(self, state: Any) -> None:
        self._t = time.perf_counter()

    @hookimpl
    def batch_end(self, state: Any) -> None:
        self.times.append(time.perf_counter() - self._t)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--backend", default=None, help="torch.compile backend (default inductor; "
                   "aot_eager with --quick)")  # fmt: skip
    p.add_argument("--with-channels-last-bf16", action="store_true",
                   help="add eager and compiled channels_last + bf16 (mixed_precision) variants")
    p.add_argument("--curriculum", action="store_true",
                   help="run (b), the image-size curriculum comparison, instead of (a)")
    p.add_argument("--variants", default="",
                   help="(b) only: comma-separated words picking variants, e.g. eager,static")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.steps, args.warmup, args.repeats = 3, 2, 1
    args.backend = args.backend or ("aot_eager" if args.quick else "inductor")
    if args.curriculum:
        curriculum(args)
    else:
        step_ratio(args)


if __name__ == "__main__":
    main()
