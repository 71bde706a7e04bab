"""Early stopping: end the run when an eval metric has stopped improving."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from slipstream import Callback, State, check_plugin_options, hookimpl, plugin_option

STATUS = "stopped_early"
# The engine's default metrics and the direction each improves in; any other evaluated
# metric improves as its plugin's higher_is_better says (the engine hands it over).
MODES = {"accuracy": "max", "accuracy_top5": "max", "loss": "min"}


@dataclass
class EarlyStoppingConfig:
    # any evaluated metric of the eval records (the engine refuses one not evaluated)
    monitor: str = "accuracy"
    # evaluations without improvement before the run stops
    patience: int = plugin_option(3, low=1, whole=True, note="evaluations")
    # an improvement smaller than this does not count
    min_delta: float = plugin_option(0.0, low=0)
    # None: the metric's direction (max for accuracy, min for loss, its plugin's otherwise)
    mode: Optional[str] = plugin_option(None, choices=("max", "min"), note="or null")

    def __post_init__(self) -> None:
        check_plugin_options(self)
        if not isinstance(self.monitor, str) or not self.monitor:
            raise ValueError(f"monitor must name an evaluated metric (accuracy, loss, ...), got {self.monitor!r}")
        if self.mode is None:
            self.mode = MODES.get(self.monitor.rpartition("/")[2])  # another's: set by monitor_higher


def improved(value: float, best: float | None, mode: str, min_delta: float) -> bool:
    """Whether ``value`` beats ``best`` by more than ``min_delta`` in ``mode``.

    >>> improved(0.52, 0.5, "max", 0.01), improved(0.505, 0.5, "max", 0.01), improved(1.0, None, "min", 0)
    (True, False, True)
    """
    if best is None:
        return True
    return value > best + min_delta if mode == "max" else value < best - min_delta


class EarlyStopping(Callback):
    """Stop the run (status stopped_early) when an eval metric (accuracy, loss, ...) stops improving."""

    name = "early_stopping"
    config_class = EarlyStoppingConfig
    needs_evaluation = True
    monitor_option = "monitor"

    def __init__(self, config: EarlyStoppingConfig | None = None) -> None:
        super().__init__(config)
        self.best: float | None = None
        self.best_step: int | None = None
        self.waited = 0  # evaluations since the last improvement

    @hookimpl
    def eval_end(self, state: State) -> None:
        # Eval metrics are all-reduced, so every rank decides alike and stops at
        # the same batch.
        cfg = self.config
        value = state.eval_metrics.get(cfg.monitor)
        if value is None:
            return
        mode = cfg.mode or ("min" if self.monitor_higher is False else "max")
        if value == value and improved(value, self.best, mode, cfg.min_delta):  # NaN never improves
            self.best, self.best_step, self.waited = value, state.timestamp.batch, 0
            return
        self.waited += 1
        # The final evaluation ends the run anyway: nothing left to stop.
        if self.waited >= cfg.patience and not state.is_done():
            state.summary["early_stopping"] = {
                "monitor": cfg.monitor,
                "best": self.best,
                "best_step": self.best_step,
                "stopped_step": state.timestamp.batch,
            }
            best = "none finite" if self.best is None else f"{self.best:.4g} at step {self.best_step}"
            state.request_stop(
                STATUS,
                f"stopped early: eval {cfg.monitor} has not improved by more than {cfg.min_delta} "
                f"for {self.waited} evaluations (best {best})",
            )

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "waited": self.waited}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_step, self.waited = state["best"], state["best_step"], state["waited"]
