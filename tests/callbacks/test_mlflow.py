"""mlflow: a file store in the run directory (unless MLFLOW_TRACKING_URI is set),
params = the resolved config, metrics per record with their step, summary.json and
config.yaml as artifacts; read back with MLflow's own client."""

from __future__ import annotations

import json
import os

import pytest
from slipstream_mlflow import MLflow, params

from helpers import train

mlflow_tracking = pytest.importorskip("mlflow.tracking")


def only_run(store_uri):
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # reading MLflow 3's file store needs it too
    try:
        client = mlflow_tracking.MlflowClient(tracking_uri=store_uri)
        experiment = client.get_experiment_by_name("slipstream")
        (run,) = client.search_runs([experiment.experiment_id])
        return client, run
    finally:
        del os.environ["MLFLOW_ALLOW_FILE_STORE"]


def test_params_metrics_and_artifacts_in_the_run_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    trainer = train(tmp_path, callbacks=[MLflow()], max_duration="2ep", log_interval=2)
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ  # allowed only while the store is built
    client, run = only_run((trainer.run_dir / "mlruns").as_uri())
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["trainer.max_duration"] == "2ep"
    assert run.data.tags["slipstream.status"] == "completed"
    records = [json.loads(line) for line in trainer.paths.metrics.read_text().splitlines()]
    for kind, key in (("train", "loss"), ("eval", "accuracy")):
        history = client.get_metric_history(run.info.run_id, f"{kind}/{key}")
        expected = [(r["step"], r[key]) for r in records if r["kind"] == kind]
        assert sorted((m.step, m.value) for m in history) == expected
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"summary.json", "config.yaml"}


def test_mlflow_tracking_uri_is_honoured(tmp_path, monkeypatch):
    store = tmp_path / "elsewhere"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    trainer = train(tmp_path, callbacks=[MLflow()], max_duration="1ba")
    assert not (trainer.run_dir / "mlruns").exists()
    _, run = only_run(store.as_uri())
    assert run.info.status == "FINISHED"


def test_params_are_flat_text():
    assert params({"a": {"b": 1, "c": [1, 2]}}) == {"a.b": "1", "a.c": "[1, 2]"}
    assert len(params({"long": "x" * 10_000})["long"]) == 6000
