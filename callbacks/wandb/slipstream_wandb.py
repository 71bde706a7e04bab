"""Weights & Biases logging, offline unless configured otherwise: the resolved
config, every metrics record with its step, and the run's final metrics as the
W&B summary. Its files go inside the run directory. wandb is imported only by a
run that enables this."""

from __future__ import annotations

import json
import netrc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

from slipstream import Callback, PluginError, RunDir, State, check_plugin_options, hookimpl, numbers, plugin_option

MODES = ("offline", "online", "disabled")
# summary.json fields copied to the W&B summary at the end.
FINAL_METRICS = ("status", "accuracy", "best_accuracy", "eval_loss", "wall_time_s", "samples_per_s", "mfu")


@dataclass
class WandBConfig:
    # offline (default): everything stays on disk, `wandb sync` uploads it later;
    # None: $WANDB_MODE, else offline.
    mode: Optional[str] = plugin_option(None, choices=MODES, note="or null")
    project: str = "slipstream"
    entity: Optional[str] = None
    run_name: Optional[str] = None  # None: the run directory's name
    dir: Optional[str] = None  # None: the run directory (files go to DIR/wandb/)

    def __post_init__(self) -> None:
        check_plugin_options(self)


def has_credentials(env: dict[str, str]) -> bool:
    """Whether wandb would find an API key: ``WANDB_API_KEY``, or the netrc entry
    that ``wandb login`` writes for the W&B host."""
    if env.get("WANDB_API_KEY"):
        return True
    host = urlparse(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or ""
    path = env.get("NETRC") or str(Path(env.get("HOME") or Path.home()) / ".netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_mode(configured: str | None, env: dict[str, str]) -> str:
    """The mode a run uses: the config's, else ``WANDB_MODE``, else offline.

    >>> resolve_mode(None, {}), resolve_mode(None, {"WANDB_MODE": "online"}), resolve_mode("disabled", {})
    ('offline', 'online', 'disabled')
    """
    mode = configured or env.get("WANDB_MODE") or "offline"
    if mode not in MODES:
        raise PluginError(f"callback 'wandb': WANDB_MODE must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


class WandB(Callback):
    """Weights & Biases run (offline by default): config, metrics per record, final summary."""

    name = "wandb"
    run_files = ("wandb",)
    config_class = WandBConfig

    def __init__(self, config: WandBConfig | None = None) -> None:
        super().__init__(config)
        self.run: Any = None
        self.mode: str | None = None
        self._wandb: Any = None

    @hookimpl
    def init(self, state: State) -> None:
        if state.rank != 0:
            return
        self.mode = resolve_mode(self.config.mode, dict(os.environ))
        if self.mode == "online" and not has_credentials(dict(os.environ)):
            # wandb would ask for a key on the terminal (or fail mid-start without one).
            raise PluginError(
                "callback 'wandb': mode online needs a W&B API key: set WANDB_API_KEY or run "
                "`wandb login`; or use mode offline and `wandb sync` later"
            )
        try:  # here, before anything is written: a missing package fails the start cleanly
            import wandb
        except ImportError as exc:
            raise PluginError(f"callback 'wandb' needs the wandb package ({exc}); pip install wandb") from None
        self._wandb = wandb

    @hookimpl
    def fit_start(self, state: State) -> None:
        if self._wandb is None:
            return
        cfg, wandb = self.config, self._wandb
        folder = Path(cfg.dir or state.run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            mode=self.mode,
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.run_name or Path(state.run_dir).name,
            dir=str(folder),
            config=state.config,
            # The console and system metrics are the terminal's and the OS's business.
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )

    @hookimpl
    def log_metrics(self, state: State, record: dict[str, Any]) -> None:
        if self.run is None:
            return
        kind = record.get("kind", "train")
        values = {f"{kind}/{k}": v for k, v in numbers(record).items() if k != "step"}
        # W&B's step must not go back; train and eval records of one step share it.
        self.run.log(values, step=record["step"])

    @hookimpl
    def fit_end(self, state: State) -> None:
        if self.run is None:
            return
        # Called after the engine wrote summary.json (callbacks observe last).
        path = RunDir(Path(state.run_dir)).summary
        summary = json.loads(path.read_text()) if path.is_file() else {}
        self.run.summary.update({f"final/{k}": summary[k] for k in FINAL_METRICS if summary.get(k) is not None})
        self._finish(0 if summary.get("status", "completed") not in ("failed", "diverged") else 1)

    @hookimpl
    def exception(self, state: State) -> None:
        self._finish(1)

    def _finish(self, exit_code: int) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish(exit_code=exit_code)
