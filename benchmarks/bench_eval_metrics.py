"""Evaluation metrics: the cost per image of an evaluation with the default metric
plugins (loss, accuracy, accuracy_top5) against the fixed code they replaced.

The same Trainer, model, eval batches and hooks in one process; the fixed code is the
evaluation loop as it was before metric plugins (commit c3e6d98, copied below), the
plugins' is the engine's Evaluator. Rounds alternate between the two; the figure is the
median over rounds of new / old time per image. Also shown: a few torchmetrics-backed
metrics added to the defaults, for what they cost.

    .venv/bin/python benchmarks/bench_eval_metrics.py --threads 1      # ~2 min idle
    .venv/bin/python benchmarks/bench_eval_metrics.py --quick
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import parser, random_loader
from slipstream import Trainer
from slipstream.models import build_model
from slipstream.services.batches import check_pair, to_device
from slipstream.services.evaluation import Evaluator, _restore_modes, class_indices


def fixed_evaluate(self: Evaluator, state: Any) -> dict[str, float]:
    """The evaluation loop before metric plugins (loss, top-1, top-5 in one tensor)."""
    model, hooks = state.model, self.hooks
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    hooks.eval_start(state=state)
    totals = torch.zeros(4, dtype=torch.float64, device=state.device)
    classes = 0
    with torch.no_grad():
        for batch in state.eval_loader:
            state.batch = to_device(batch, state.device)
            check_pair(state.batch, "evaluation")
            hooks.eval_batch_start(state=state)
            self.prepare(state)
            state.outputs = hooks.forward(state=state)
            logits = state.outputs[0] if isinstance(state.outputs, (tuple, list)) else state.outputs
            targets = state.batch[1]
            totals[0] += F.cross_entropy(logits.float(), targets, reduction="sum")
            targets = class_indices(targets, logits)
            totals[1] += (logits.argmax(dim=1) == targets).sum()
            totals[2] += targets.numel()
            classes = logits.shape[1]
            if classes >= 5:
                top = logits.topk(5, dim=1).indices
                totals[3] += (top == targets.unsqueeze(1)).any(dim=1).sum()
            hooks.eval_batch_end(state=state)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals)
    loss_sum, correct, count, correct_top5 = totals.tolist()
    metrics = {"loss": loss_sum / count, "accuracy": correct / count}
    if classes >= 5:
        metrics["accuracy_top5"] = correct_top5 / count
    state.eval_metrics = metrics
    hooks.eval_end(state=state)
    _restore_modes(model, modes)
    return metrics


def trainer(model_name: str, size: int, batch: int, batches: int, metrics: Any = None) -> Trainer:
    torch.manual_seed(0)
    model = build_model(model_name, 10, image_size=size)
    data = random_loader(batch * batches, size, batch)
    return Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), train_data=data,
                   eval_data=data, metrics=metrics, device="cpu", progress_bar=False, verbose=False,
                   autotune=False, run_dir=None, checkpoint_interval=None)  # fmt: skip


def bench(model_name: str, size: int, batch: int, batches: int, rounds: int) -> None:
    images = batch * batches
    plugins = trainer(model_name, size, batch, batches)
    more = trainer(model_name, size, batch, batches, ["loss", "accuracy", "accuracy_top5", "f1_macro",
                                                      "calibration_error"])  # fmt: skip
    variants = {
        "fixed code": lambda: fixed_evaluate(plugins.evaluator, plugins.state),
        "metric plugins (defaults)": lambda: plugins.evaluator.evaluate(plugins.state),
        "+ f1_macro, calibration_error": lambda: more.evaluator.evaluate(more.state),
    }
    first = {name: run() for name, run in variants.items()}  # warm-up, and the values agree
    assert first["fixed code"] == first["metric plugins (defaults)"], first
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            started = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - started) / images)
    base = times["fixed code"]
    print(f"\n{model_name} at {size} px, batch {batch}, {images} images, {torch.get_num_threads()} threads, "
          f"{rounds} rounds")  # fmt: skip
    for name, per_image in times.items():
        ratio = statistics.median(t / b for t, b in zip(per_image, base, strict=True))
        print(f"  {name:32s} {1e6 * statistics.median(per_image):9.1f} us/image   {ratio:.3f}x")


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        bench("test_resnet", 16, 32, 2, 3)
        return
    bench("resnet18", 32, 256, 4, args.rounds)  # CIFAR-sized: the model's cost dominates
    bench("test_resnet", 16, 64, 16, args.rounds)  # a toy model: the metrics' own cost shows


if __name__ == "__main__":
    main()
