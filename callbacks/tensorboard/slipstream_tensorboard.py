"""TensorBoard logging: every metrics record as scalars, hyper-parameters and final
metrics at the end. tensorboard is imported only by a run that enables this."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from slipstream import (
    Callback,
    PluginError,
    RunDir,
    State,
    check_plugin_options,
    flatten,
    hookimpl,
    numbers,
    plugin_option,
)

# summary.json fields shown as the run's final metrics next to its hyper-parameters.
FINAL_METRICS = ("accuracy", "best_accuracy", "eval_loss", "wall_time_s", "samples_per_s", "mfu")


@dataclass
class TensorBoardConfig:
    log_dir: Optional[str] = None  # None: RUN_DIR/tensorboard
    # how often the writer flushes to disk
    flush_secs: int = plugin_option(30, low=1, whole=True, note="seconds")

    def __post_init__(self) -> None:
        check_plugin_options(self)


def hparams(config: dict[str, Any]) -> dict[str, Any]:
    """The resolved config as TensorBoard hyper-parameters: flat keys, and values
    it accepts (numbers, strings, bools; anything else as its text).

    >>> hparams({"optimizer": {"lr": 0.1, "betas": [0.9, 0.99]}, "model": {"kwargs": {}}})
    {'optimizer.lr': 0.1, 'optimizer.betas': '[0.9, 0.99]', 'model.kwargs': '{}'}
    """
    return {
        key: value if isinstance(value, (int, float, str, bool)) else json.dumps(value)
        for key, value in flatten(config).items()
    }


class TensorBoard(Callback):
    """TensorBoard scalars of every train/eval record, hyper-parameters and final metrics."""

    name = "tensorboard"
    run_files = ("tensorboard",)
    config_class = TensorBoardConfig

    def __init__(self, config: TensorBoardConfig | None = None) -> None:
        super().__init__(config)
        self.writer: Any = None
        self._writer_class: Any = None
        self.log_dir: Path | None = None

    @hookimpl
    def init(self, state: State) -> None:
        if state.rank != 0:
            return
        try:  # here, before anything is written: a missing package fails the start cleanly
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise PluginError(
                f"callback 'tensorboard' needs the tensorboard package ({exc}); "
                "pip install tensorboard"
            ) from None
        self._writer_class = SummaryWriter

    @hookimpl
    def fit_start(self, state: State) -> None:
        if self._writer_class is None:
            return
        self.log_dir = Path(self.config.log_dir or Path(state.run_dir) / "tensorboard")
        self.writer = self._writer_class(log_dir=str(self.log_dir), flush_secs=self.config.flush_secs)

    @hookimpl
    def log_metrics(self, state: State, record: dict[str, Any]) -> None:
        if self.writer is None:
            return
        kind, step = record.get("kind", "train"), record["step"]
        for key, value in numbers(record).items():
            if key not in ("step", "epoch"):
                self.writer.add_scalar(f"{kind}/{key}", value, global_step=step)
        self.writer.add_scalar(f"{kind}/epoch", record["epoch"], global_step=step)

    @hookimpl
    def fit_end(self, state: State) -> None:
        if self.writer is None:
            return
        # Called after the engine wrote summary.json (callbacks observe last).
        summary_path = RunDir(Path(state.run_dir)).summary
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        final = {f"final/{k}": summary[k] for k in FINAL_METRICS if isinstance(summary.get(k), (int, float))}
        self.writer.add_hparams(hparams(state.config), final, run_name="hparams")
        self.close()

    @hookimpl
    def exception(self, state: State) -> None:
        self.close()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
