"""Small models, data and probes shared by the tests (imported as `helpers`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import timm
import torch
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Algorithm, Trainer, hookimpl
from slipstream.hookspecs import EVENTS

# Warnings are lines of their own (`slipstream: warning: ...`) and may come before an
# error from something the test is not about: the CPU kind's (mixed_precision's "this
# CPU has no bf16 units"), a library's. A test of an error's one line counts the rest.
WARNING_PREFIX = "slipstream: warning: "

# A tiny `slipstream train`: timm's smallest ResNet on 32 training and 16 evaluation
# synthetic images of 16 pixels, in batches of 16, on one thread. Tests add what they are
# about (a duration, a run directory, --quiet) after it.
TINY_RUN = [
    "model.name=test_resnet",
    "data.train_size=32",
    "data.val_size=16",
    "data.image_size=16",
    "data.batch_size=16",
    "trainer.threads=1",
]

# The bundled recipes of published ImageNet procedures: they need the user's data, so
# test_published_recipes.py trains them on a JPEG folder at toy scale.
PUBLISHED_RECIPES = ("resnet50_rsb_a3", "deit_small", "resnet50_composer_medium", "resnet50_composer_hot")


def error_lines(err: str) -> list[str]:
    """``err``'s non-empty lines less the engine's warnings: what a one-line error test counts."""
    return [line for line in err.strip().splitlines() if line and not line.startswith(WARNING_PREFIX)]


def colour_image_folder(
    root: Path, classes: dict[str, tuple[int, int, int]], per_class: int = 2, size: int = 8
) -> Path:
    """An ImageFolder tree (``root/{train,val}/<class>/<i>.png``) of PNGs written with
    Pillow: each class one colour, its images a shade apart."""
    from PIL import Image

    for split in ("train", "val"):
        for name, colour in classes.items():
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(per_class):
                shade = tuple(min(255, c + 9 * i) for c in colour)
                Image.new("RGB", (size, size), shade).save(folder / f"{i}.png")
    return root


def tiny_loaders(
    n: int = 64, image_size: int = 16, batch_size: int = 16, num_classes: int = 4, seed: int = 0
) -> tuple[DataLoader, DataLoader]:
    """A learnable toy problem (class = brightest channel quadrant) in [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, image_size, image_size, generator=g)
    y = torch.arange(n) % num_classes
    half = image_size // 2
    for i in range(n):
        r, c = divmod(int(y[i]) % 4, 2)
        x[i, :, r * half : (r + 1) * half, c * half : (c + 1) * half] += 0.5
    x = x.clamp(0, 1)
    train = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)
    val = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)
    return train, val


def tiny_model(kind: str = "resnet", num_classes: int = 4, image_size: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "resnet":
        return timm.create_model("test_resnet", num_classes=num_classes)
    if kind == "vit":
        return timm.create_model(
            "test_vit",
            num_classes=num_classes,
            img_size=image_size,
            patch_size=8,
            dynamic_img_size=True,
        )
    raise ValueError(kind)


class Probe(Algorithm):
    """Calls ``fn(state)`` at the named hooks; records every event it sees."""

    name = "probe"

    def __init__(self, **callbacks: Callable[[Any], None]) -> None:
        super().__init__()
        self.callbacks = callbacks
        self.events: list[str] = []


def _make_event(event: str):
    def handler(self, state, **_):
        self.events.append(event)
        if event in self.callbacks:
            self.callbacks[event](state)

    handler.__name__ = event
    return hookimpl(handler)


for _event in EVENTS:
    if _event in ("exception", "log_metrics"):
        continue
    setattr(Probe, _event, _make_event(_event))


def train(
    tmp_path: Path,
    algorithms: list[Algorithm] = (),  # type: ignore[assignment]
    *,
    model: torch.nn.Module | None = None,
    max_duration: str = "2ep",
    image_size: int = 16,
    lr: float = 0.05,
    **kwargs: Any,
) -> Trainer:
    """Fit a tiny model with ``algorithms`` and return the finished Trainer."""
    train_data, eval_data = tiny_loaders(image_size=image_size)
    train_data = kwargs.pop("train_data", train_data)
    eval_data = kwargs.pop("eval_data", eval_data)
    model = model or tiny_model(image_size=image_size)
    kwargs.setdefault("progress_bar", False)
    kwargs.setdefault("verbose", False)
    trainer = Trainer(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
        train_data=train_data,
        eval_data=eval_data,
        max_duration=max_duration,
        algorithms=list(algorithms),
        run_dir=tmp_path / "run",
        device="cpu",
        **kwargs,
    )
    trainer.fit()
    return trainer


def fake_distribution(
    site: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str]
) -> Path:
    """Write an installed-looking distribution (dist-info with entry points) into
    ``site``; put ``site`` on sys.path (or PYTHONPATH) to make it discoverable."""
    site.mkdir(parents=True, exist_ok=True)
    for module, source in modules.items():
        (site / f"{module}.py").write_text(source)
    info = site / f"{dist.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    lines = [f"{name} = {target}" for name, target in entry_points.items()]
    (info / "entry_points.txt").write_text("[slipstream.algorithms]\n" + "\n".join(lines) + "\n")
    return site


def record_worker_shutdowns(monkeypatch) -> list[tuple[list[bool], str]]:
    """Record each DataLoader worker shutdown that does something: whether each worker
    was alive then, and the name of the function that asked (``stop_workers``, or
    ``__del__`` when the loader was left to the garbage collector)."""
    import sys

    import torch.utils.data.dataloader as dataloader

    seen: list[tuple[list[bool], str]] = []
    shutdown = dataloader._MultiProcessingDataLoaderIter._shutdown_workers

    def recorded(iterator) -> None:
        if not iterator._shutdown:  # a second call does nothing
            seen.append(([w.is_alive() for w in iterator._workers], sys._getframe(1).f_code.co_name))
        shutdown(iterator)

    monkeypatch.setattr(dataloader._MultiProcessingDataLoaderIter, "_shutdown_workers", recorded)
    return seen


class ScriptedMetric(Algorithm):
    """Each evaluation's ``metric`` replaced by the next of ``values`` (the last one
    again once they run out), so the best evaluation is known in advance. Algorithms act
    before the engine and the callbacks read the metrics, so they see the scripted value."""

    name = "scripted_eval"

    def __init__(self, values: list[float], metric: str = "accuracy") -> None:
        super().__init__()
        self.values, self.metric, self.seen = list(values), metric, 0

    @hookimpl
    def eval_end(self, state: Any) -> None:
        state.eval_metrics[self.metric] = self.values[min(self.seen, len(self.values) - 1)]
        self.seen += 1


class ConstantMetric:
    """A metric plugin of one's own that computes 0.0: a test scripts its values with
    :class:`ScriptedMetric` and subclasses this for a name and a direction."""

    name = "constant"
    higher_is_better = True

    def update(self, outputs: Any, targets: Any) -> None:
        pass

    def compute(self) -> float:
        return 0.0

    def reset(self) -> None:
        pass
