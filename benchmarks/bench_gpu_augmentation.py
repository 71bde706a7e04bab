"""gpu_augmentation: kornia batch augmentation vs torchvision v2 per-sample transforms.

(a) Augmentation alone, images/s: the ``light`` preset (RandomResizedCrop scale
    (0.35, 1) + horizontal flip) on whole batches with kornia, against the same
    transforms applied per sample by torchvision.transforms.v2 inside a DataLoader
    (num_workers 0 and 1), and a loader with no transform for reference.
(b) End to end, ResNet-18 at 32 px through the real Trainer: no augmentation vs v2
    per-sample augmentation in the loader vs the gpu_augmentation plugin.
(c) What ``cpu_threads`` costs: short runs of the ``resnet18_fast`` recipe through the
    Trainer (flips on the CPU at every batch, channels-last) with the augmentation at
    torch's threads (``cpu_threads: 0``, the default) and at 1 thread (``cpu_threads:
    1``, a switch of torch's thread count and back every batch), alternated; the
    median step of each run, and the ratio per pair of runs.
(d) timm's recipe stages, ms per batch, side by side: the ``rand_augment`` stage
    (``rand-m9-mstd0.5-inc1``, per image on the batch) and ``erasing`` (probability
    0.25, pixel mode) against the ``light`` preset, and against timm's own
    per-image RandAugment on PIL images and RandomErasing on the normalised tensors,
    at 32 px (batch 128) and 160 px (batch 32, ResNet strikes back A3's size).

    .venv/bin/python benchmarks/bench_gpu_augmentation.py            # ~4 min
    .venv/bin/python benchmarks/bench_gpu_augmentation.py --skip-e2e   # (a) and (c)
    .venv/bin/python benchmarks/bench_gpu_augmentation.py --quick    # seconds
    .venv/bin/python benchmarks/bench_gpu_augmentation.py --only-timm  # (d) alone, ~1 min
"""

from __future__ import annotations

import statistics
import tempfile
import time

import timm
import torch
from PIL import Image, ImageOps
from slipstream_gpu_augmentation import (
    Erasing,
    GpuAugmentation,
    GpuAugmentationConfig,
    augment_batch,
    build_augmentation,
    intra_op_threads,
    parse_rand_augment,
    rand_augment,
    random_erase,
)
from timm.data.auto_augment import rand_augment_transform
from timm.data.random_erasing import RandomErasing
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from common import StepClock, compare, parser, random_loader, report
from slipstream import Algorithm, hookimpl
from slipstream.config.schema import build_config
from slipstream.run.build import build_trainer


class Augmented(Dataset):
    """Images in [0, 1] transformed one by one, as a classic input pipeline does."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform) -> None:
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        return self.transform(self.images[i]), self.labels[i]


def light_v2(size: int) -> v2.Compose:
    # The plugin's `light` preset, per sample.
    return v2.Compose([v2.RandomResizedCrop(size, scale=(0.35, 1.0)), v2.RandomHorizontalFlip()])


def loader(images, labels, batch_size: int, transform=None, workers: int = 0) -> DataLoader:
    pairs = list(zip(images, labels, strict=True))
    data = Augmented(images, labels, transform) if transform else pairs
    return DataLoader(
        data, batch_size=batch_size, shuffle=False, drop_last=True, num_workers=workers
    )


def timed(run) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) for ``run()``. On a shared,
    oversubscribed machine the CPU time is the steadier measure of cost."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - cpu


def aug_throughput(args) -> None:
    size, bs, batches = 32, args.batch_size, args.aug_batches
    data = random_loader(bs * (batches + 1), size, bs).dataset.tensors
    pipeline = build_augmentation()

    def kornia_batches() -> None:
        with intra_op_threads(args.aug_threads):  # as the plugin does on the CPU
            for i, x in enumerate(data[0].split(bs)[1:]):
                augment_batch(x, pipeline, seed=i)

    # name -> DataLoader to drain, or None for kornia on ready batches.
    variants: dict[str, DataLoader | None] = {"kornia batch (light)": None}
    for workers in args.workers:
        variants[f"v2 per-sample, workers={workers}"] = loader(*data, bs, light_v2(size), workers)
    variants["loader, no transform"] = loader(*data, bs)
    walls: dict[str, list[float]] = {name: [] for name in variants}
    cpus: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):  # interleaved, so machine noise hits all alike
        for name, dl in variants.items():
            if dl is None:
                augment_batch(data[0][:bs], pipeline, seed=0)  # kornia's first-call set-up
                run = kornia_batches
            else:  # start workers and fill the first batch outside the timing
                it = iter(dl)
                next(it)

                def run(it=it) -> None:
                    for _ in it:
                        pass

            wall, cpu = timed(run)
            walls[name].append(bs * batches / wall)
            cpus[name].append(bs * batches / max(cpu, 1e-9))
    base_wall = statistics.median(walls["kornia batch (light)"])
    base_cpu = statistics.median(cpus["kornia batch (light)"])
    print(
        f"(a) augmentation alone, {bs}x3x{size}x{size} batches, {torch.get_num_threads()} threads"
    )
    print(f"{'variant':<32} {'images/s':>10} {'vs kornia':>10} {'img/CPU-s':>10} {'vs kornia':>10}")
    for name in variants:
        wall, cpu = statistics.median(walls[name]), statistics.median(cpus[name])
        # A worker's CPU time is not this process's: only wall time means something there.
        in_process = variants[name] is None or variants[name].num_workers == 0
        cpu_text = f"{cpu:>10.0f} {cpu / base_cpu:>9.2f}x" if in_process else f"{'n/a':>10}"
        print(f"{name:<32} {wall:>10.0f} {wall / base_wall:>9.2f}x {cpu_text}")


class CpuTimer(Algorithm):
    """Process CPU time at the end of every batch."""

    name = "bench_cpu_timer"

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    @hookimpl
    def batch_end(self, state) -> None:
        self.times.append(time.process_time())


def end_to_end(args) -> None:
    size, bs = 32, args.batch_size
    n = bs * (args.warmup + args.steps)
    images, labels = random_loader(n, size, bs).dataset.tensors
    v2_name = f"v2 per-sample in loader (w={args.e2e_workers})"
    timers: dict[str, list[CpuTimer]] = {}
    cfg = GpuAugmentationConfig(cpu_threads=args.aug_threads)

    def build(name, algorithms):
        def variant():
            torch.manual_seed(0)
            model = timm.create_model(args.model, num_classes=10)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            timer = CpuTimer()
            timers.setdefault(name, []).append(timer)
            return model, opt, [*algorithms(), timer]

        return variant

    variants = {
        "no augmentation": build("no augmentation", list),
        v2_name: build(v2_name, list),
        "gpu_augmentation (light)": build(
            "gpu_augmentation (light)", lambda: [GpuAugmentation(cfg)]
        ),
    }
    loaders = {
        "no augmentation": loader(images, labels, bs),
        v2_name: loader(images, labels, bs, light_v2(size), args.e2e_workers),
        "gpu_augmentation (light)": loader(images, labels, bs),
    }
    results = compare(
        variants, loaders.__getitem__, steps=args.steps, warmup=args.warmup, repeats=args.repeats
    )
    report(
        f"(b) {args.model} at {size} px, batch {bs}, {torch.get_num_threads()} threads, "
        "training step time (speed-up vs no augmentation)",
        results,
    )
    w = args.warmup
    cpu = {
        name: statistics.median((t.times[-1] - t.times[w - 1]) / (len(t.times) - w) for t in ts)
        for name, ts in timers.items()
    }
    base = cpu["no augmentation"]
    print("CPU time per step (this process; steadier than wall time on a shared machine)")
    for name, c in cpu.items():
        print(f"{name:<28} {1000 * c:>9.1f} {base / c:>8.2f}x")


def recipe_step_s(overrides: list[str], batches: int) -> float:
    """Median step, in seconds, of a short `resnet18_fast` run (every plugin on, no evaluation)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = build_config(
            "resnet18_fast",
            None,
            [
                *overrides,
                f"data.train_size={32 * batches}",
                "data.val_size=32",
                f"trainer.max_duration={batches}ba",
                "trainer.eval_interval=null",
                f"trainer.run_dir={tmp}/run",
                "trainer.progress_bar=false",
                f"trainer.threads={torch.get_num_threads()}",
            ],
        )
        trainer = build_trainer(cfg, verbose=False)
        clock = StepClock()
        trainer.pm.register(clock)
        trainer.fit()
    return statistics.median(b - a for a, b in zip(clock.times[5:-1], clock.times[6:], strict=True))


def thread_switch(args) -> None:
    times: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(args.switch_runs):  # alternated, so machine phases hit both alike
        for threads in times:
            overrides = [f"algorithms.gpu_augmentation.cpu_threads={threads}"]
            times[threads].append(recipe_step_s(overrides, args.switch_batches))
    ratios = sorted(b / a for a, b in zip(times[0], times[1], strict=True))
    print(
        f"(c) resnet18_fast's step with cpu_threads 0 and 1, {args.switch_runs} alternated runs of "
        f"{args.switch_batches} batches, {torch.get_num_threads()} threads: median step "
        f"{1e3 * statistics.median(times[0]):.1f} / {1e3 * statistics.median(times[1]):.1f} ms; "
        f"cpu_threads 1 over 0, per pair of runs: median {ratios[len(ratios) // 2]:.3f}, "
        f"range {ratios[0]:.3f}-{ratios[-1]:.3f}"
    )


def _posterize_zero_bits(img: Image.Image, bits: int, **_) -> Image.Image:
    # What Pillow gave for 0 bits before it refused them: black (the plugin does the same).
    return Image.new(img.mode, img.size) if bits < 1 else ImageOps.posterize(img, bits)


def timm_stages(args) -> None:
    """(d): the timm stages' cost per batch, ours on the batch against timm's per image."""
    text = "rand-m9-mstd0.5-inc1"
    spec, erasing = parse_rand_augment(text), Erasing(probability=0.25, mode="pixel")
    theirs_ra = rand_augment_transform(text, {"translate_const": 100, "img_mean": (128, 128, 128)})
    for op in theirs_ra.ops:  # Pillow 13 refuses posterize(0 bits), which timm asks for at magnitude 10
        if op.name == "PosterizeIncreasing":
            op.aug_fn = _posterize_zero_bits
    theirs_re = RandomErasing(probability=0.25, mode="pixel", device="cpu")
    light = build_augmentation()
    print(f"(d) timm's stages, ms per batch (median of {args.repeats} interleaved runs of "
          f"{args.timm_batches} batches), {torch.get_num_threads()} threads")
    print(f"{'batch':<14} {'variant':<38} {'ms/batch':>9} {'vs timm':>8}")
    for size, bs in args.timm_sizes:
        g = torch.Generator().manual_seed(0)
        batches = [torch.rand(bs, 3, size, size, generator=g) for _ in range(args.timm_batches)]
        images = [[Image.fromarray((x * 255).byte().permute(1, 2, 0).numpy()) for x in b] for b in batches]
        variants = {
            "light preset (kornia)": lambda i, b: augment_batch(b, light, seed=i),
            f"rand_augment {text}": lambda i, b: rand_augment(b, spec, seed=i),
            "erasing p0.25 pixel": lambda i, b: random_erase(b, erasing, seed=i),
            "timm RandAugment, per PIL image": lambda i, b, images=images: [theirs_ra(im) for im in images[i]],
            "timm RandomErasing, per image": lambda i, b: theirs_re(b.clone()),
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        for run in variants.values():  # first calls (kornia's set-up) untimed
            run(0, batches[0])
        for _ in range(args.repeats):
            for name, run in variants.items():
                start = time.perf_counter()
                for i, b in enumerate(batches):
                    run(i, b)
                times[name].append((time.perf_counter() - start) / len(batches))
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        against = {"rand_augment": "timm RandAugment, per PIL image", "erasing": "timm RandomErasing, per image"}
        for name, value in ms.items():
            ref = next((ms[v] for k, v in against.items() if name.startswith(k)), None)
            ratio = f"{ref / value:>7.2f}x" if ref else f"{'':>8}"
            print(f"{bs}x3x{size}x{size:<5} {name:<38} {value:>9.2f} {ratio}")


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--aug-batches", type=int, default=20, help="batches per timing in (a)")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1], help="loader workers in (a)")
    p.add_argument("--e2e-workers", type=int, default=0, help="loader workers for v2 in (b)")
    p.add_argument(
        "--aug-threads", type=int, default=0, help="the plugin's cpu_threads (0 = --threads)"
    )
    p.add_argument("--switch-runs", type=int, default=10, help="runs per setting in (c)")
    p.add_argument("--switch-batches", type=int, default=40, help="batches per run in (c)")
    p.add_argument("--skip-e2e", action="store_true", help="leave out (b)")
    p.add_argument("--only-timm", action="store_true", help="run (d) alone")
    p.add_argument("--timm-batches", type=int, default=5, help="batches per timing in (d)")
    p.set_defaults(steps=5, warmup=1, repeats=3)  # ResNet-18 steps take seconds on a shared CPU
    args = p.parse_args()
    if args.quick:
        args.batch_size, args.aug_batches, args.steps, args.warmup, args.repeats = 16, 3, 2, 1, 1
        args.model, args.workers = "test_resnet", [0]
        args.switch_runs, args.switch_batches = 1, 8
    args.timm_sizes = [(32, 16)] if args.quick else [(32, 128), (160, 32)]
    torch.set_num_threads(args.threads)
    if args.only_timm:
        timm_stages(args)
        return
    aug_throughput(args)
    if not args.skip_e2e:
        end_to_end(args)
    thread_switch(args)
    timm_stages(args)


if __name__ == "__main__":
    main()
