"""Everyday paths (issue 29): automatic resume of a preempted run, fine-tuning from a
checkpoint, evaluating and exporting one, and a user's own model, optimizer and loss
named by import path. CLI runs are in-process (``cli.main``) to keep them cheap."""

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch

from helpers import Probe, colour_image_folder, error_lines, record_worker_shutdowns, tiny_model, train
from slipstream import CheckpointError, ConfigError, Trainer, load_checkpoint
from slipstream.cli.main import main
from slipstream.models import build_loss, build_model
from slipstream.optim import build_optimizer
from slipstream.run.checkpoint import load_weights
from slipstream.run.inference import export_checkpoint, rebuild

RECIPE = """
model: {name: test_resnet}
data: {num_classes: 10, train_size: 64, val_size: 32, image_size: 16, batch_size: 16}
optimizer: {lr: 0.01}
trainer: {threads: 1, progress_bar: false, max_duration: 4ba, log_interval: 1}
algorithms: {ema: {decay: 0.5}, channels_last: {}, activation_checkpointing: {}}
"""


def _params(trainer):
    return [p.detach().clone() for p in trainer.state.unwrapped_model.parameters()]


def _weights(path):
    return load_checkpoint(path)["model"]


# -- automatic resume ----------------------------------------------------------------------


class SigtermOnce(Probe):
    """Sends SIGTERM to this process after batch ``at`` of the first run only, as a
    scheduler preempting the job would."""

    name = "sigterm_once"

    def __init__(self, at):
        self.sent = False
        super().__init__(batch_end=self._maybe_signal)
        self.at = at

    def _maybe_signal(self, state):
        if not self.sent and state.timestamp.batch == self.at:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.fixture(scope="module")
def one_thread():
    # Module fixtures run before conftest's per-test one thread; bit-identical
    # comparisons need the same thread count on both sides.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, one_thread):
    # No evaluation in these runs: it neither draws random numbers nor changes weights.
    run = train(tmp_path_factory.mktemp("straight"), [SigtermOnce(at=-1)], max_duration="7ba",
                checkpoint_interval=None, eval_interval=None)
    return _params(run)


@pytest.mark.parametrize("cut", ["sigterm", "max_duration"])
def test_a_preempted_run_continued_by_autoresume_ends_bit_identical(tmp_path, cut, uninterrupted):
    probe = SigtermOnce(at=3 if cut == "sigterm" else -1)
    first_duration = "7ba" if cut == "sigterm" else "3ba"
    first = train(tmp_path / "split", [probe], max_duration=first_duration, autoresume=True, eval_interval=None)
    assert first.state.timestamp.batch == 3
    if cut == "sigterm":
        assert json.loads((first.run_dir / "summary.json").read_text())["status"] == "interrupted"
    probe.sent = True  # the requeued job is not signalled again
    resumed = train(tmp_path / "split", [probe], max_duration="7ba", autoresume=True, eval_interval=None)
    assert resumed.state.timestamp.batch == 7
    assert json.loads((resumed.run_dir / "summary.json").read_text())["status"] == "completed"
    for a, b in zip(uninterrupted, _params(resumed), strict=True):
        assert torch.equal(a, b)


def test_autoresume_starts_fresh_and_refuses_a_changed_config(tmp_path):
    run = train(tmp_path, [], max_duration="2ba", autoresume=True)  # nothing there: starts
    assert run.state.timestamp.batch == 2
    latest = run.run_dir / "checkpoints" / "latest.pt"
    before = latest.read_bytes()
    with pytest.raises(ConfigError, match=r"these keys differ: optimizer\.lr, trainer\.seed"):
        train(tmp_path, [], max_duration="4ba", autoresume=True, seed=1, lr=0.5)
    assert latest.read_bytes() == before  # nothing written
    model = tiny_model()
    with pytest.raises(ConfigError, match="autoresume needs a fixed run_dir"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), [], autoresume=True)


def test_autoresume_without_checkpoints_is_refused_and_a_finished_run_is_kept(tmp_path):
    # Issue 44, case 5: with checkpoint_interval=null a finished run was cleared
    # (metrics.jsonl, summary.json) and trained again from step 0 without a word.
    with pytest.raises(ConfigError, match="autoresume continues from the run's checkpoints, but "
                                          "checkpoint_interval is null"):
        train(tmp_path, [], max_duration="2ba", autoresume=True, checkpoint_interval=None)
    assert not (tmp_path / "run").exists()
    done = train(tmp_path, [], max_duration="2ba", checkpoint_interval=None)  # ended, no checkpoint
    files = {p: p.read_bytes() for p in (done.run_dir / "metrics.jsonl", done.run_dir / "summary.json")}
    with pytest.raises(ConfigError, match=r"ended \(completed\) and kept no checkpoint to continue from"):
        train(tmp_path, [], max_duration="2ba", autoresume=True)
    assert all(path.read_bytes() == data for path, data in files.items())


def test_a_resume_at_the_end_of_a_run_without_summary_writes_one(tmp_path):
    # Issue 44, case 6: killed after its last checkpoint, before summary.json: the resume
    # printed a made-up summary (accuracy -, epochs None) and never wrote one.
    done = train(tmp_path, [], max_duration="4ba", checkpoint_interval="2ba", eval_interval=None)
    expected = done.summary["accuracy"]
    (done.run_dir / "summary.json").unlink()
    with pytest.warns(UserWarning, match="wrote no summary.json .*evaluating and writing it now"):
        resumed = train(tmp_path, [], max_duration="4ba", checkpoint_interval="2ba", eval_interval=None,
                        autoresume=True)
    written = json.loads((resumed.run_dir / "summary.json").read_text())
    assert written["status"] == "completed" and written["batches"] == 4
    assert written["accuracy"] == expected  # the final evaluation of the same weights
    assert written["samples_per_s"] is None and written["mfu"] is None  # not known, not made up


# -- a CLI run shared by the fine-tuning, eval and export tests ----------------------------------


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, one_thread):
    """A 10-class run with EMA, channels-last and activation checkpointing, trained by
    the CLI with autoresume in two parts (2 then 4 batches)."""
    root = tmp_path_factory.mktemp("cli")
    recipe = root / "tiny.yaml"
    recipe.write_text(RECIPE)
    run = root / "run"
    for duration in ("2ba", "4ba"):
        code = main(["train", "-q", "-r", str(recipe), f"trainer.run_dir={run}",
                     "trainer.autoresume=true", f"trainer.max_duration={duration}"])
        assert code == 0
    return recipe, run


def test_cli_autoresume_continues_the_run(cli_run, tmp_path):
    recipe, run = cli_run
    straight = tmp_path / "straight"
    assert main(["train", "-q", "-r", str(recipe), f"trainer.run_dir={straight}"]) == 0
    a, b = _weights(run / "checkpoints" / "latest.pt"), _weights(straight / "checkpoints" / "latest.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cli_autoresume_refuses_another_config_in_one_line(cli_run, capsys):
    recipe, run = cli_run
    code = main(["train", "-q", "-r", str(recipe), f"trainer.run_dir={run}", "trainer.autoresume=true",
                 "algorithms.ema.decay=0.9", "data.batch_size=8"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "these keys differ: algorithms.ema.decay, data.batch_size" in err


@pytest.mark.parametrize(
    "override", ["loss.kwargs.label_smoothing=0.3", "model.kwargs.drop_rate=0.5", "optimizer.kwargs.nesterov=true"]
)
def test_cli_autoresume_refuses_a_keyword_the_first_run_did_not_set(cli_run, capsys, override):
    # Issue 44, case 1: the first run's `{}` against a keyword now was taken as a key of
    # another version, and the resume trained on with the new keyword without a word.
    recipe, run = cli_run
    latest = run / "checkpoints" / "latest.pt"
    before = latest.read_bytes()
    code = main(["train", "-q", "-r", str(recipe), f"trainer.run_dir={run}", "trainer.autoresume=true", override])
    err = capsys.readouterr().err
    assert code == 2 and f"these keys differ: {override.split('.')[0]}.kwargs" in err, err
    assert latest.read_bytes() == before


def test_a_resume_compares_keyword_mappings_whole():
    from slipstream.run.checkpoint import config_differences, resumed_with_changes

    saved = {"loss": {"kwargs": {}}, "model": {"kwargs": {"drop_rate": 0.1}}, "algorithms": {"ema": {}}}
    now = {"loss": {"kwargs": {"label_smoothing": 0.3}}, "model": {"kwargs": {}}, "algorithms": {"ema": {}}}
    keys = config_differences(saved, now)
    assert keys == ["loss.kwargs", "model.kwargs"]
    told = resumed_with_changes(Path("latest.pt"), saved, now, keys)
    assert "loss.kwargs {} -> {'label_smoothing': 0.3}, model.kwargs {'drop_rate': 0.1} -> {}" in told
    assert config_differences(saved, saved) == []


# -- fine-tuning ---------------------------------------------------------------------------------


def test_a_10_class_checkpoint_fine_tunes_into_a_3_class_model(cli_run, tmp_path, capsys):
    recipe, run = cli_run
    checkpoint = run / "checkpoints" / "latest.pt"
    common = ["train", "-q", "-r", str(recipe), "data.num_classes=3", f"trainer.load_path={checkpoint}",
              "trainer.load_weights_only=true", "trainer.max_duration=1ba", "algorithms.ema=null"]
    # The head does not fit: one line naming the weights, nothing trained.
    code = main([*common, f"trainer.run_dir={tmp_path / 'refused'}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "fc.weight (10, 96) vs (3, 96)" in err and "load_ignore_keys" in err
    assert not (tmp_path / "refused" / "checkpoints").exists()
    # A new head, the backbone frozen by its LR scale of 0: the backbone is the checkpoint's.
    tuned = tmp_path / "tuned"
    code = main([*common, "trainer.load_ignore_keys=[fc.*]", "optimizer.backbone_lr_scale=0",
                 f"trainer.run_dir={tuned}"])
    assert code == 0, capsys.readouterr().err
    before, after = _weights(checkpoint), _weights(tuned / "checkpoints" / "latest.pt")
    assert after["fc.weight"].shape == (3, 96)
    params = [k for k in before if k.endswith(("weight", "bias")) and not k.startswith("fc.")]
    assert params and all(torch.equal(before[k], after[k]) for k in params)
    payload = load_checkpoint(tuned / "checkpoints" / "latest.pt")
    assert payload["timestamp"]["batch"] == 1  # counters start afresh
    lrs = sorted(g["lr"] for g in payload["optimizer"]["param_groups"])
    assert lrs[0] == 0.0 and lrs[-1] == 0.01
    # The log's `lr` is the first group's; with groups of other LRs, each is logged (issue 44).
    records = [json.loads(line) for line in (tuned / "metrics.jsonl").read_text().splitlines()]
    logged = next(r for r in records if r["kind"] == "train")
    assert logged["lr"] == 0.0 and sorted(set(logged["lr_groups"])) == [0.0, 0.01]
    assert "lr_groups" not in json.loads((run / "metrics.jsonl").read_text().splitlines()[0])  # one LR


def test_fine_tuning_patterns_that_do_nothing_are_refused(cli_run, tmp_path, capsys):
    """Issue 44, case 11: load_ignore_keys that match no weight (a typo would load the head
    it meant to leave out), optimizer.head matching everything (backbone_lr_scale a no-op),
    and `[*]` read by YAML as an alias: each one line, nothing trained."""
    recipe, run = cli_run
    common = ["train", "-q", "-r", str(recipe), f"trainer.load_path={run / 'checkpoints' / 'latest.pt'}",
              "trainer.load_weights_only=true", "trainer.max_duration=1ba", "algorithms.ema=null"]  # fmt: skip
    cases = [
        (["trainer.load_ignore_keys=[head.*]"], "trainer.load_ignore_keys: 'head.*' matches no weight of ResNet"),
        (['optimizer.head=["*"]', "optimizer.backbone_lr_scale=0.1"],
         "optimizer.head (*) matches every trainable parameter of ResNet, so optimizer.backbone_lr_scale=0.1"),
        (["optimizer.head=[*]"], "YAML reads a value starting with * as an alias"),
    ]  # fmt: skip
    for i, (overrides, message) in enumerate(cases):
        code = main([*common, *overrides, f"trainer.run_dir={tmp_path / str(i)}"])
        lines = error_lines(capsys.readouterr().err)
        assert code == 2 and len(lines) == 1 and message in lines[0], lines
        assert not (tmp_path / str(i) / "checkpoints").exists()


def test_ema_weights_are_selectable(cli_run):
    _, run = cli_run
    checkpoint = run / "checkpoints" / "latest.pt"
    payload = load_checkpoint(checkpoint)
    ema = payload["plugins"]["ema"]["state"]["weights"]
    model = build_model("test_resnet", 10)
    load_weights(model, checkpoint, weights="ema")
    assert all(torch.equal(v, ema[k]) for k, v in model.state_dict().items())
    assert not torch.equal(ema["fc.weight"], payload["model"]["fc.weight"])
    with pytest.raises(CheckpointError, match="holds no 'swa' weights; it holds: model, ema"):
        load_weights(model, checkpoint, weights="swa")


def test_layer_decay_and_backbone_lr_give_per_group_lrs():
    vit = tiny_model("vit")
    groups = build_optimizer(vit, "adamw", 1.0, layer_decay=0.5).param_groups
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    depth = len(vit.blocks)
    assert lr_of[id(vit.head.weight)] == 1.0
    assert lr_of[id(vit.blocks[-1].mlp.fc1.weight)] == 0.5
    assert lr_of[id(vit.patch_embed.proj.weight)] == 0.5 ** (depth + 1)
    resnet = tiny_model()
    groups = build_optimizer(resnet, "sgd", 0.1, backbone_lr_scale=0.1).param_groups
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    assert lr_of[id(resnet.fc.weight)] == 0.1 and lr_of[id(next(resnet.parameters()))] == pytest.approx(0.01)
    with pytest.raises(ConfigError, match="choose one"):
        build_optimizer(resnet, "sgd", 0.1, backbone_lr_scale=0.1, layer_decay=0.7)


# -- eval and export -------------------------------------------------------------------------------


def test_eval_reproduces_the_runs_final_evaluation(cli_run, tmp_path, capsys):
    _, run = cli_run
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if r["kind"] == "eval"][-1]  # evaluated with the EMA
    out = tmp_path / "ema.json"
    assert main(["eval", "--checkpoint", str(run), "--ema", "-o", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["weights"] == "ema" and printed["samples"] == 32
    assert printed["loss"] == pytest.approx(final["loss"], rel=1e-5)
    assert printed["accuracy"] == pytest.approx(final["accuracy"])
    assert main(["eval", "--checkpoint", str(run), "-o", str(tmp_path / "model.json")]) == 0
    live = json.loads(capsys.readouterr().out)
    assert live["weights"] == "model" and live["loss"] != printed["loss"]


@pytest.mark.parametrize("fmt", ["torchscript", "exported-program"])
def test_an_exported_model_matches_the_eager_one(cli_run, tmp_path, fmt):
    _, run = cli_run
    out = tmp_path / ("model.pt" if fmt == "torchscript" else "model.pt2")
    if fmt == "exported-program":  # torch.export's package name: another is refused, nothing written
        with pytest.raises(ConfigError, match=r"an exported-program file ends in \.pt2"):
            export_checkpoint(run, fmt, tmp_path / "model.bin", weights="ema")
        assert not (tmp_path / "model.bin").exists()
    result = export_checkpoint(run, fmt, out, weights="ema")
    assert result["matches"] and result["algorithms"] == ["channels_last", "activation_checkpointing"]
    assert result["any_batch_size"]
    # Checked again here, on other inputs of other batch sizes than the export's, against
    # the eager model with the EMA weights.
    eager = rebuild(run, weights="ema").model.float().eval()
    loaded = torch.jit.load(str(out)) if fmt == "torchscript" else torch.export.load(str(out)).module()
    for batch in (1, 3):
        inputs = torch.randn(batch, 3, 16, 16)
        with torch.no_grad():
            torch.testing.assert_close(loaded(inputs), eager(inputs), atol=1e-5, rtol=1e-4)


def test_onnx_export_matches_the_eager_one(cli_run, tmp_path, capsys):
    pytest.importorskip("onnxruntime", reason="the onnx extra (pip install 'slipstream[onnx]') is not installed")
    pytest.importorskip("onnxscript", reason="the onnx extra (pip install 'slipstream[onnx]') is not installed")
    _, run = cli_run
    out = tmp_path / "model.onnx"
    assert main(["export", "-c", str(run), "--format", "onnx", "-o", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["matches"] and result["max_abs_diff"] < 1e-4 and out.stat().st_size > 0
    import onnxruntime

    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    for batch in (1, 3):  # any batch size, not only the export's
        (outputs,) = session.run(None, {session.get_inputs()[0].name: torch.randn(batch, 3, 16, 16).numpy()})
        assert outputs.shape[0] == batch


def test_activation_checkpointing_is_undone_for_export():
    from slipstream_activation_checkpointing import (
        ActivationCheckpointing,
        apply_activation_checkpointing,
        checkpointed_modules,
    )

    model = tiny_model()
    assert apply_activation_checkpointing(model) and checkpointed_modules(model)
    model.set_grad_checkpointing(True)
    exported = ActivationCheckpointing().export_model(model)
    assert checkpointed_modules(exported) == [] and not exported.grad_checkpointing
    inputs = torch.randn(2, 3, 16, 16)
    traced = torch.jit.trace(exported.eval(), inputs)  # no checkpoint call left in the graph
    torch.testing.assert_close(traced(inputs), exported(inputs))


def test_bad_eval_and_export_input_is_one_line(cli_run, tmp_path, capsys):
    _, run = cli_run
    cases = [
        (["eval", "-c", str(tmp_path / "none.pt")], "does not exist"),
        (["eval", "-c", str(run), "--weights", "swa"], "holds no 'swa' weights; it holds: model, ema"),
        (["export", "-c", str(run), "-f", "torchscript", "-o", str(tmp_path / "m.pt"), "model.name=no.such:net"],
         "model.name='no.such:net': cannot import module 'no.such'"),
    ]
    for args, fragment in cases:
        assert main(args) == 2
        err = capsys.readouterr().err
        assert fragment in err and "Traceback" not in err, err
    assert not (tmp_path / "m.pt").exists()


def test_eval_and_export_replace_no_file_unasked_and_never_the_checkpoint(cli_run, tmp_path, capsys):
    # Issue 44, case 3: `-o` replaced any file, the checkpoint being read included.
    _, run = cli_run
    latest = run / "checkpoints" / "latest.pt"
    kept = latest.read_bytes()
    mine = tmp_path / "mine.json"
    mine.write_text("a file of the user's\n")
    refused = [
        (["export", "-c", str(latest), "-f", "torchscript", "-o", str(latest)], "is the checkpoint being read"),
        (["export", "-c", str(run), "-f", "torchscript", "-o", str(latest), "--overwrite"],
         "is the checkpoint being read"),
        (["eval", "-c", str(run), "-o", str(latest), "--overwrite"], "is the checkpoint being read"),
        (["eval", "-c", str(run), "-o", str(mine)], f"-o {mine} exists; give --overwrite to replace it"),
        (["export", "-c", str(run), "-f", "torchscript", "-o", str(tmp_path)], "is a directory"),
    ]
    for args, fragment in refused:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert fragment in err and "Traceback" not in err, err
    assert latest.read_bytes() == kept and mine.read_text() == "a file of the user's\n"
    assert main(["eval", "-c", str(run), "-o", str(mine), "--overwrite"]) == 0  # asked: replaced
    assert "accuracy" in json.loads(mine.read_text())
    exported = tmp_path / "m.pt"
    assert main(["export", "-c", str(run), "-f", "torchscript", "-o", str(exported)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt", "mine.json"]  # no partial file left


def test_a_failed_export_leaves_no_partial_file_and_the_old_one(tmp_path, monkeypatch):
    from slipstream.run import inference

    model = tiny_model()
    out = tmp_path / "m.pt"
    out.write_bytes(b"the previous export")

    def fails_midway(*args, **kwargs):
        (args[4]).write_bytes(b"half a file")  # the partial file, then the failure
        raise RuntimeError("the writer broke")

    monkeypatch.setattr(inference, "_export_and_check", fails_midway)
    with pytest.raises(RuntimeError, match="the writer broke"):
        inference.export_model(model, torch.rand(2, 3, 16, 16), "torchscript", out)
    assert out.read_bytes() == b"the previous export" and [p.name for p in tmp_path.iterdir()] == ["m.pt"]


# -- import paths ---------------------------------------------------------------------------------

USER_MODULE = '''
import torch
from torch import nn

calls = {"loss": 0}


def build_net(num_classes, width=8, image_size=None):
    assert image_size == 16
    return nn.Sequential(nn.Conv2d(3, width, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))


class Momentumless(torch.optim.SGD):
    def __init__(self, params, lr, scale=1.0):
        super().__init__(params, lr=lr * scale)


def smooth_ce(outputs, targets, smoothing=0.0):
    calls["loss"] += 1
    return nn.functional.cross_entropy(outputs, targets, label_smoothing=smoothing)
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_models", None)


def test_own_model_optimizer_and_loss_by_import_path(user_module, tmp_path):
    run = tmp_path / "run"
    code = main(["train", "-q", "-r", "default", "--algorithms", "no:stepwise_lr,no:mixed_precision,no:channels_last",
                 "model.name=my_models:build_net", "model.kwargs.width=4", "optimizer.name=my_models:Momentumless",
                 "optimizer.lr=0.1", "optimizer.kwargs.scale=0.5",
                 "loss.name=my_models:smooth_ce", "loss.kwargs.smoothing=0.1",
                 "data.train_size=32", "data.val_size=16", "data.image_size=16", "data.batch_size=16",
                 "trainer.max_duration=2ba", "trainer.threads=1", f"trainer.run_dir={run}"])
    assert code == 0
    import my_models

    assert my_models.calls["loss"] == 3  # two training batches, and the final evaluation's one batch
    payload = load_checkpoint(run / "checkpoints" / "latest.pt")
    assert payload["model"]["3.weight"].shape == (10, 4)
    assert payload["optimizer_class"] == "Momentumless"
    assert {g["lr"] for g in payload["optimizer"]["param_groups"]} == {0.05}
    assert isinstance(build_model("my_models:build_net", 3, image_size=16), torch.nn.Module)
    assert build_loss("my_models:smooth_ce")(torch.zeros(2, 3), torch.tensor([0, 1])) > 0


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("model.name=my_models:missing", "model.name='my_models:missing': module 'my_models' has no 'missing'"),
        ("optimizer.name=torch.nn:Linear", "optimizer.name='torch.nn:Linear' is not a torch.optim.Optimizer"),
        ("loss.name=nowhere:fn", "loss.name='nowhere:fn': cannot import module 'nowhere'"),
    ],
)
def test_a_bad_import_path_is_one_line_naming_it(user_module, tmp_path, capsys, override, fragment):
    code = main(["train", "-q", "model.name=test_resnet", "data.image_size=16", "data.train_size=32",
                 "data.val_size=16", override,
                 f"trainer.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert fragment in err, err
    assert not (tmp_path / "run").exists()


def test_eval_ends_its_loader_workers_before_returning(cli_run, tmp_path, capsys, monkeypatch):
    _, run = cli_run
    stopped = record_worker_shutdowns(monkeypatch)
    args = ["eval", "--checkpoint", str(run), "-o", str(tmp_path / "m.json")]
    assert main([*args, "data.num_workers=2", "data.persistent_workers=true"]) == 0
    assert stopped == [([True, True], "stop_workers")]  # the eval loader's, not left to the exit


# -- class names travel with the weights (issue 44, case 2) ---------------------------------------


def test_class_names_are_kept_checked_at_eval_and_exported(tmp_path, capsys):
    colours = {"a": (250, 0, 0), "b": (0, 250, 0), "c": (0, 0, 250)}
    trained = colour_image_folder(tmp_path / "abc", colours, per_class=4, size=16)
    run = tmp_path / "run"
    common = ["-q", "model.name=test_resnet", "data.name=imagefolder", "data.image_size=16", "data.batch_size=4",
              "trainer.max_duration=2ba", "trainer.threads=1", "algorithms={}"]
    assert main(["train", *common, f"data.root={trained}", f"trainer.run_dir={run}"]) == 0
    assert load_checkpoint(run / "checkpoints" / "latest.pt")["classes"] == ["a", "b", "c"]
    # Other folders: the same images under other names, sorted into another order, were
    # scored against the wrong indices (accuracy 0.0 without a word).
    renamed = colour_image_folder(tmp_path / "other", {"b": colours["b"], "c": colours["c"], "x_a": colours["a"]},
                                  per_class=4, size=16)
    capsys.readouterr()
    assert main(["eval", "-c", str(run), f"data.root={renamed}", "-o", str(tmp_path / "e.json")]) == 2
    err = capsys.readouterr().err
    assert "only in the data ['x_a'], only in the checkpoint ['a']" in err and "Traceback" not in err, err
    assert not (tmp_path / "e.json").exists()
    assert main(["eval", "-c", str(run), f"data.root={trained}", "-o", str(tmp_path / "e.json")]) == 0
    # A test set that comes without a training split (ImageNet-V2's val/ alone) evaluates:
    # slipstream eval reads the evaluation split only. The same images, the same metrics.
    shutil.copytree(trained / "val", tmp_path / "v2" / "val")
    assert main(["eval", "-c", str(run), f"data.root={tmp_path / 'v2'}", "-o", str(tmp_path / "v2.json")]) == 0
    on_v2, on_trained = (json.loads((tmp_path / f).read_text()) for f in ("v2.json", "e.json"))
    assert on_v2["loss"] == pytest.approx(on_trained["loss"]) and on_v2["accuracy"] == on_trained["accuracy"]
    out = tmp_path / "m.pt"
    capsys.readouterr()
    assert main(["export", "-c", str(run), "-f", "torchscript", "-o", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["classes"] == ["a", "b", "c"]
    extra = {"classes.json": ""}
    torch.jit.load(str(out), _extra_files=extra)
    assert json.loads(extra["classes.json"]) == ["a", "b", "c"]


def test_eval_and_export_refuse_non_finite_weights(cli_run, tmp_path, capsys):
    # Issue 44: eval of a checkpoint with NaN weights reported an accuracy, exit 0, and
    # wrote NaN into its JSON.
    _, run = cli_run
    payload = load_checkpoint(run / "checkpoints" / "latest.pt")
    name = next(k for k, v in payload["model"].items() if v.is_floating_point())
    payload["model"][name] = torch.full_like(payload["model"][name], float("nan"))
    bad = tmp_path / "bad.pt"
    torch.save(payload, bad)
    capsys.readouterr()
    for args in (["eval", "-c", str(bad), "-o", str(tmp_path / "e.json")],
                 ["export", "-c", str(bad), "-f", "torchscript", "-o", str(tmp_path / "m.pt")]):
        assert main(args) != 0
        err = capsys.readouterr().err
        assert f"are not finite (NaN or infinity in {name}" in err and "Traceback" not in err, err
    assert not (tmp_path / "e.json").exists() and not (tmp_path / "m.pt").exists()
