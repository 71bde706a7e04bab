"""`slipstream average`: a run's last or best checkpoints averaged into one checkpoint
that evaluates and exports like any other, and `trainer.keep_best`, which keeps the
best ones."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from helpers import TINY_RUN, ConstantMetric, ScriptedMetric, error_lines, tiny_loaders, tiny_model
from slipstream import CheckpointError, Trainer, load_checkpoint
from slipstream.cli.main import main
from slipstream.run.average import average_state_dicts
from slipstream.run.checkpoint import save_checkpoint


@pytest.fixture(scope="module", autouse=True)
def _no_flop_count():
    """The runs here make checkpoints; counting their FLOPs for MFU (a traced forward and
    backward, most of a tiny run's time) is not what this file tests."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("slipstream.services.utilization.training_flops_per_sample", lambda model, inputs: 1.0)
        yield


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory):
    """2 epochs of 2 batches with ema, a checkpoint and an evaluation at each epoch's end."""
    run = tmp_path_factory.mktemp("average") / "run"
    args = ["train", "-q", "-a", "ema", *TINY_RUN, "trainer.max_duration=2ep", "trainer.eval_interval=1ep"]
    args += ["trainer.autotune=false"]
    assert main([*args, "algorithms.ema.decay=0.5", "trainer.checkpoint_keep=-1", f"trainer.run_dir={run}"]) == 0
    return run


def scripted_run(tmp_path, keep_best):
    """4 epochs of one batch, eval losses 0.5, 0.9, 0.7, 0.8: the best are steps 1 and 3."""
    data, _ = tiny_loaders(n=16)
    model = tiny_model()
    trainer = Trainer(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        train_data=data,
        eval_data=data,
        max_duration="4ep",
        algorithms=[ScriptedMetric([0.5, 0.9, 0.7, 0.8], "loss")],
        run_dir=tmp_path / "run",
        device="cpu",
        checkpoint_keep=1,
        keep_best=keep_best,
        best_metric="loss",
        progress_bar=False,
        verbose=False,
    )
    trainer.fit()
    return trainer


def held(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").glob("ep*.pt"))


def test_state_dicts_are_averaged_in_float64_and_cast_back_integers_from_the_last():
    big, small = torch.tensor([1e8, 1.0], dtype=torch.float32), torch.tensor([1.0, 3.0], dtype=torch.float32)
    dicts = [
        {"w": big, "h": torch.tensor([1.0], dtype=torch.bfloat16), "n": torch.tensor(3)},
        {"w": small, "h": torch.tensor([2.0], dtype=torch.bfloat16), "n": torch.tensor(7)},
        {"w": small, "h": torch.tensor([4.0], dtype=torch.bfloat16), "n": torch.tensor(9)},
    ]
    out = average_state_dicts(dicts)
    wide = (big.double() + 2 * small.double()) / 3
    assert torch.equal(out["w"], wide.float()) and out["w"].dtype == torch.float32
    assert out["h"].dtype == torch.bfloat16 and out["h"].item() == pytest.approx(7 / 3, rel=1e-2)
    assert out["n"].item() == 9 and out["n"].dtype == torch.int64  # the last one's, not a mean
    with pytest.raises(ValueError, match="w"):
        average_state_dicts([dicts[0], {**dicts[1], "w": torch.zeros(3)}])


def test_last_n_averages_model_and_ema_and_the_file_evaluates_and_exports(ema_run, tmp_path, capsys):
    out = tmp_path / "avg.pt"
    assert main(["average", str(ema_run), "--last", "2", "-o", str(out)]) == 0
    sources = [load_checkpoint(ema_run / "checkpoints" / n) for n in ("ep1-ba2.pt", "ep2-ba4.pt")]
    averaged = load_checkpoint(out)
    record = averaged["averaged"]
    assert record["mode"] == "last" and record["weights"] == ["model", "ema"]
    assert [s["step"] for s in record["sources"]] == [2, 4]
    for name, tensor in averaged["model"].items():
        a, b = (s["model"][name] for s in sources)
        if tensor.is_floating_point():
            assert torch.equal(tensor, ((a.double() + b.double()) / 2).to(a.dtype)), name
        else:
            assert torch.equal(tensor, b), name  # num_batches_tracked: the latest
    ema = [s["plugins"]["ema"]["state"]["weights"] for s in sources]
    conv = next(k for k in ema[0] if k.endswith("weight"))
    assert not torch.equal(ema[0][conv], ema[1][conv])  # so the mean below is a mean of two
    expected = ((ema[0][conv].double() + ema[1][conv].double()) / 2).float()
    assert torch.equal(averaged["plugins"]["ema"]["state"]["weights"][conv], expected)
    assert averaged["optimizer"] is None and "rng" not in averaged
    capsys.readouterr()

    assert main(["eval", "-c", str(out), "--ema", "-o", str(tmp_path / "e.json")]) == 0
    assert '"accuracy"' in capsys.readouterr().out
    export = ["export", "-c", str(out), "--format", "torchscript", "-o", str(tmp_path / "m.pt"), "--no-check"]
    assert main(export) == 0
    scripted = torch.jit.load(str(tmp_path / "m.pt"))
    assert scripted(torch.zeros(1, 3, 16, 16)).shape == (1, 10)

    # No run continues from it (it holds no optimizer state), before anything is written.
    model = tiny_model()
    with pytest.raises(CheckpointError, match="trainer.load_weights_only=true"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), [], load_path=out, run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_the_output_file_is_never_replaced_unasked_nor_a_checkpoint_of_the_run(ema_run, tmp_path, capsys):
    mine = tmp_path / "mine.pt"
    mine.write_bytes(b"mine")
    for target, extra, words in (
        (mine, [], "exists; give --overwrite"),
        # Not even with --overwrite:
        (ema_run / "checkpoints" / "latest.pt", ["--overwrite"], "is a checkpoint of the run"),
        (tmp_path, ["--overwrite"], "is a directory"),
    ):
        assert main(["average", str(ema_run), "--last", "2", "-o", str(target), *extra]) == 2
        errors = error_lines(capsys.readouterr().err)
        assert len(errors) == 1 and words in errors[0], errors
    assert mine.read_bytes() == b"mine"
    assert main(["average", str(ema_run), "--last", "2", "-o", str(mine), "--overwrite"]) == 0
    assert load_checkpoint(mine)["averaged"]["count"] == 2


def test_a_full_disk_is_one_line_and_leaves_no_file(ema_run, tmp_path, capsys, monkeypatch):
    real = os.fdopen

    class Full:
        def __init__(self, file):
            self.file = file

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    monkeypatch.setattr("slipstream.run.directory.os.fdopen", lambda fd, *a, **k: Full(real(fd, *a, **k)))
    assert main(["average", str(ema_run), "--last", "2", "-o", str(tmp_path / "avg.pt")]) == 2
    errors = error_lines(capsys.readouterr().err)
    assert errors == [f"slipstream: error: cannot use {tmp_path / 'avg.pt'}: the disk is full"]
    assert list(tmp_path.iterdir()) == []


def test_checkpoints_of_another_model_are_refused_by_name(ema_run, tmp_path, capsys):
    other = tmp_path / "run" / "checkpoints"
    other.mkdir(parents=True)
    for name in ("ep1-ba2.pt", "ep2-ba4.pt"):
        payload = load_checkpoint(ema_run / "checkpoints" / name)
        if name == "ep1-ba2.pt":
            payload["config"]["model"]["name"] = "resnet18"
        save_checkpoint(payload, other / name)
    assert main(["average", str(tmp_path / "run"), "--last", "2", "-o", str(tmp_path / "a.pt")]) == 2
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and "different models" in errors[0] and "resnet18" in errors[0], errors


def test_keep_best_keeps_the_best_and_best_n_averages_them(tmp_path, capsys):
    trainer = scripted_run(tmp_path / "on", keep_best=2)
    run = trainer.run_dir
    assert held(run) == ["ep1-ba1.pt", "ep3-ba3.pt", "ep4-ba4.pt"]  # the best two and the last
    assert load_checkpoint(run / "checkpoints" / "ep1-ba1.pt")["eval"]["loss"] == 0.5
    out = tmp_path / "best.pt"
    assert main(["average", str(run), "--best", "2", "-o", str(out)]) == 0
    record = load_checkpoint(out)["averaged"]
    assert record["metric"] == "loss" and [(s["step"], s["value"]) for s in record["sources"]] == [(1, 0.5), (3, 0.7)]
    capsys.readouterr()
    # --last 2 needs the last two: checkpoint_keep=1 kept one (ep1 and ep3 are there for their loss).
    assert main(["average", str(run), "--last", "2", "-o", str(tmp_path / "last.pt")]) == 2
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and "trainer.checkpoint_keep=2" in errors[0], errors

    off = scripted_run(tmp_path / "off", keep_best=0).run_dir
    assert held(off) == ["ep4-ba4.pt"]
    # best.pt (step 1) and the last: two checkpoints with a loss.
    assert main(["average", str(off), "--best", "3", "-o", str(tmp_path / "b.pt")]) == 2
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and "holds 2 checkpoint" in errors[0] and "trainer.keep_best=3" in errors[0], errors


class Hits(ConstantMetric):
    """A metric of one's own, higher better, that no table of the engine names: its
    values come from ScriptedMetric."""

    name = "hits"


def test_best_n_ranks_by_any_metric_in_its_direction(tmp_path, capsys):
    from slipstream.run.average import ranking

    data, _ = tiny_loaders(n=16)
    model = tiny_model()
    trainer = Trainer(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), train_data=data, eval_data=data,
        max_duration="4ep", algorithms=[ScriptedMetric([0.5, 0.9, 0.7, 0.8], "hits")], metrics=["loss", Hits],
        run_dir=tmp_path / "run", device="cpu", checkpoint_keep=1, keep_best=2, best_metric="hits",
        progress_bar=False, verbose=False,
    )  # fmt: skip
    trainer.fit()
    run = trainer.run_dir
    # Higher is better: the best are steps 2 and 4 (0.9, 0.8), where loss's direction would keep 1 and 3.
    assert held(run) == ["ep2-ba2.pt", "ep4-ba4.pt"]
    ranked_by = load_checkpoint(run / "checkpoints" / "ep2-ba2.pt")["ranked_by"]
    assert ranked_by == {"metric": "hits", "higher_is_better": True}
    out = tmp_path / "best.pt"
    assert main(["average", str(run), "--best", "2", "-o", str(out)]) == 0
    record = load_checkpoint(out)["averaged"]
    assert record["metric"] == "hits" and [(s["step"], s["value"]) for s in record["sources"]] == [(2, 0.9), (4, 0.8)]
    # A checkpoint from before "ranked_by": the direction its metric plugin declares, or one line.
    old = {"config": {"trainer": {"best_metric": "hits"}, "evaluation": {"metrics": ["loss", "test_average:Hits"]}}}
    assert ranking(old) == ("hits", True)
    assert ranking({"config": {"trainer": {"best_metric": "hits"}, "evaluation": {"metrics": None}}}) == ("hits", None)
    for path in (run / "checkpoints").glob("*.pt"):
        payload = load_checkpoint(path)
        del payload["ranked_by"]
        save_checkpoint(payload, path)
    capsys.readouterr()
    assert main(["average", str(run), "--best", "2", "-o", str(tmp_path / "b.pt")]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "trainer.best_metric=hits" in line and "whether higher is better" in line and "--last" in line
