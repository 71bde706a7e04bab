"""wandb: offline by default, its files inside the run directory, no network; the
offline run file (.wandb) is read back and holds every record and the final summary."""

from __future__ import annotations

import json
import struct
import time

import pytest
from slipstream_wandb import WandB, WandBConfig, resolve_mode

from helpers import train
from slipstream import PluginError

pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")

BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of framed records


def wandb_records(path):
    """The protobuf records of a .wandb file (wandb ships no reader for it any more):
    a 7-byte ':W&B' header, then records framed as crc32 (4), length (2), type (1)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # the block's zero padding
            pos += left
            continue
        if pos + 7 + length > len(data):  # a record still being written
            return
        body = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        parts = body if kind in (1, 2) else parts + body  # full/first, middle/last
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            yield record


def finished_records(path, timeout=60.0):
    """The records once the run's exit record is in the file: run.finish() waits for
    wandb's service to handle the exit, but the service's writer flushes the file
    when its stream closes, moments later (under load, after finish has returned)."""
    deadline = time.monotonic() + timeout
    while True:
        records = list(wandb_records(path)) if path.stat().st_size > 7 else []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def items(update):
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in update}


def test_offline_run_files_hold_every_record_and_the_summary(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    trainer = train(tmp_path, callbacks=[WandB()], max_duration="2ep", log_interval=2)
    (run_folder,) = (trainer.run_dir / "wandb").glob("offline-run-*")
    (run_file,) = run_folder.glob("run-*.wandb")
    history, summary, config = [], {}, {}
    for record in finished_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append(items(record.history.item))
        elif kind == "summary":
            summary.update(items(record.summary.update))
        elif kind == "run":
            config.update(items(record.run.config.update))
    records = [json.loads(line) for line in trainer.paths.metrics.read_text().splitlines()]
    logged_loss = [(h["_step"], h["train/loss"]) for h in history if "train/loss" in h]
    assert logged_loss == [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    logged_acc = [(h["_step"], h["eval/accuracy"]) for h in history if "eval/accuracy" in h]
    assert logged_acc == [(r["step"], r["accuracy"]) for r in records if r["kind"] == "eval"]
    assert summary["final/accuracy"] == trainer.summary["accuracy"]
    assert summary["final/status"] == "completed"
    assert config["trainer"]["max_duration"] == "2ep"


def test_wandb_mode_is_honoured(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    trainer = train(tmp_path, callbacks=[WandB()], max_duration="1ba")
    assert not list((trainer.run_dir / "wandb").glob("offline-run-*"))
    assert resolve_mode(None, {}) == "offline" and resolve_mode("offline", {"WANDB_MODE": "online"}) == "offline"
    with pytest.raises(PluginError, match="WANDB_MODE must be one of offline, online, disabled"):
        resolve_mode(None, {"WANDB_MODE": "sometimes"})
    with pytest.raises(ValueError, match="mode must be one of"):
        WandBConfig(mode="cloud")
