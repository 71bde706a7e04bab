"""MLflow tracking: the resolved config as params, every metrics record as metrics
(with its step), summary.json and config.yaml as artifacts. mlflow is imported only
by a run that enables this."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from slipstream import Callback, PluginError, RunDir, State, flatten, hookimpl, numbers

FOLDER = "mlruns"
# MLflow caps a param's value at 6000 characters and a log_batch call at 100 params
# and 1000 metrics.
MAX_VALUE = 6000
BATCH = 100


@dataclass
class MLflowConfig:
    tracking_uri: Optional[str] = None  # None: $MLFLOW_TRACKING_URI, else a file store in RUN_DIR/mlruns
    experiment: str = "slipstream"  # created when missing
    run_name: Optional[str] = None  # None: the run directory's name


def params(config: dict[str, Any]) -> dict[str, str]:
    """The resolved config as MLflow params: flat keys, text values within MLflow's limit.

    >>> params({"optimizer": {"lr": 0.1, "betas": [0.9, 0.99]}, "trainer": {"run_dir": None}})
    {'optimizer.lr': '0.1', 'optimizer.betas': '[0.9, 0.99]', 'trainer.run_dir': 'None'}
    """
    return {
        key: (value if isinstance(value, str) else json.dumps(value) if isinstance(value, list) else str(value))[
            :MAX_VALUE
        ]
        for key, value in flatten(config).items()
    }


@contextmanager
def _file_store_allowed() -> Iterator[None]:
    """MLflow 3 refuses its file store unless MLFLOW_ALLOW_FILE_STORE is set; allow it
    while the store is built (MLflow caches it per URI), without leaving the setting
    in this process's environment."""
    saved = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)


class MLflow(Callback):
    """MLflow run: config as params, metrics per record, summary.json and config.yaml as artifacts."""

    name = "mlflow"
    run_files = (FOLDER,)
    config_class = MLflowConfig

    def __init__(self, config: MLflowConfig | None = None) -> None:
        super().__init__(config)
        self.client: Any = None
        self.run_id: str | None = None
        self.tracking_uri: str | None = None
        self._entities: Any = None

    @hookimpl
    def init(self, state: State) -> None:
        if state.rank != 0:
            return
        try:  # here, before anything is written: a missing package fails the start cleanly
            from mlflow import entities
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise PluginError(
                f"callback 'mlflow' needs the mlflow package ({exc}); pip install mlflow-skinny"
            ) from None
        self._entities = entities
        self._client_class = MlflowClient

    @hookimpl
    def fit_start(self, state: State) -> None:
        if self._entities is None:
            return
        uri = self.config.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        local = not uri
        if local:
            uri = (Path(state.run_dir).resolve() / FOLDER).as_uri()
        with _file_store_allowed() if local else nullcontext():
            self.client = self._client_class(tracking_uri=uri)
        self.tracking_uri = uri
        experiment = self.client.get_experiment_by_name(self.config.experiment)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(self.config.experiment)
        )
        run = self.client.create_run(
            experiment_id, run_name=self.config.run_name or Path(state.run_dir).name
        )
        self.run_id = run.info.run_id
        Param = self._entities.Param
        items = [Param(k, v) for k, v in params(state.config).items()]
        for start in range(0, len(items), BATCH):
            self.client.log_batch(self.run_id, params=items[start : start + BATCH])

    @hookimpl
    def log_metrics(self, state: State, record: dict[str, Any]) -> None:
        if self.run_id is None:
            return
        kind, step, now = record.get("kind", "train"), record["step"], int(time.time() * 1000)
        Metric = self._entities.Metric
        metrics = [
            Metric(f"{kind}/{key}", value, now, step)
            for key, value in numbers(record).items()
            if key != "step"
        ]
        self.client.log_batch(self.run_id, metrics=metrics)

    @hookimpl
    def fit_end(self, state: State) -> None:
        if self.run_id is None:
            return
        # Called after the engine wrote summary.json (callbacks observe last).
        paths = RunDir(Path(state.run_dir))
        for path in (paths.summary, paths.config):
            if path.is_file():
                self.client.log_artifact(self.run_id, str(path))
        status = state.stop_status or "completed"
        self.client.set_tag(self.run_id, "slipstream.status", status)
        self._finish("KILLED" if status == "interrupted" else "FAILED" if status == "diverged" else "FINISHED")

    @hookimpl
    def exception(self, state: State, error: BaseException) -> None:
        if self.run_id is not None:
            self._finish("KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED")

    def _finish(self, status: str) -> None:
        run_id, self.run_id = self.run_id, None
        self.client.set_terminated(run_id, status)
