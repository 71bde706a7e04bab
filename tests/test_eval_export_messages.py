"""What `eval` and `export` say (issue 44, case 12): a weight mismatch advises what eval
allows, an unreadable checkpoint says what is wrong in words, the weights evaluated are
named where the run evaluated others, and torch's export warnings are one line each."""

from __future__ import annotations

import warnings

import pytest
import torch

from helpers import TINY_RUN, error_lines, tiny_model
from slipstream import CheckpointError, load_checkpoint
from slipstream.cli.main import main

TINY = [*TINY_RUN, "trainer.max_duration=2ba"]


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("ema") / "run"
    assert main(["train", "-q", "-a", "ema", *TINY, "algorithms.ema.decay=0.5", f"trainer.run_dir={run}"]) == 0
    return run


def test_issue_44_case_12_a_weight_mismatch_at_eval_advises_what_eval_allows(ema_run, tmp_path, capsys):
    """Issue 44, case 12: eval's weight-mismatch error advised trainer.load_ignore_keys,
    which eval refuses; now it says to drop the overrides that changed the model, or to
    fine-tune another model first."""
    assert main(["eval", "-c", str(ema_run), "-o", str(tmp_path / "e.json"), "model.name=test_vit"]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "weights do not fit VisionTransformer" in line
    assert "drop the overrides that change the model (model.name=test_vit)" in line
    assert "fine-tune one from it first" in line
    assert "Leave such weights at their initialisation with trainer.load_ignore_keys" not in line


def test_issue_44_case_12_eval_of_an_ema_run_says_which_weights_it_evaluated(ema_run, tmp_path, capsys):
    """Issue 44, case 12: `eval` of an EMA run evaluated the raw weights while the run's
    summary reports the EMA's accuracy, without a word; now a warning names the weights
    evaluated and how to get the others, and `--ema` evaluates without one."""
    assert main(["eval", "-c", str(ema_run), "-o", str(tmp_path / "model.json")]) == 0
    err = capsys.readouterr().err
    assert ("slipstream: warning: evaluating the model's own weights of "
            f"{ema_run}; the run evaluated with its ema weights") in err
    assert "give --weights ema for those" in err
    assert main(["eval", "-c", str(ema_run), "--ema", "-o", str(tmp_path / "ema.json")]) == 0
    assert "the run evaluated with" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"", "the file is empty (0 bytes)"),
        (b"model:\n  name: test_resnet\ntrainer: {max_duration: 1ep}\n",
         "this is a YAML file (a config or a recipe?), not a checkpoint"),
        (b'{"kind": "train", "loss": 1.0}\n', "this is a JSON file, not a checkpoint"),
    ],
)
def test_issue_44_case_12_a_file_that_is_no_checkpoint_says_what_it_is(tmp_path, content, reason):
    """Issue 44, case 12: a YAML file given as a checkpoint suggested torch's
    `weights_only=False` (which would run any code, and make no config a checkpoint)."""
    path = tmp_path / "given.pt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as failed:
        load_checkpoint(path)
    assert str(failed.value).startswith(f"checkpoint {path} cannot be read: {reason}")
    assert "weights_only" not in str(failed.value)


def test_issue_44_case_12_a_corrupt_checkpoint_is_described_in_words_not_a_zip_code(tmp_path, monkeypatch):
    """Issue 44, case 12: a corrupt checkpoint's reason read "(101)", a raw zip error code."""
    whole = tmp_path / "whole.pt"
    torch.save({"w": torch.zeros(1000)}, whole)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(whole.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"cut\.pt cannot be read: the file is cut short \(its zip archive"):
        load_checkpoint(cut)

    def damaged(*args, **kwargs):
        raise RuntimeError("PytorchStreamReader failed reading file data/0: file read failed (101)")

    monkeypatch.setattr(torch, "load", damaged)
    with pytest.raises(CheckpointError) as failed:
        load_checkpoint(whole)
    assert "the file is damaged or cut short" in str(failed.value) and "(101)" not in str(failed.value)


def test_issue_44_case_12_torchs_export_warnings_are_one_line_each_and_its_noise_dropped(tmp_path, monkeypatch):
    """Issue 44, case 12: `export` printed torch's raw warnings (FutureWarnings that
    torch.jit is deprecated, each with a line of torch's source); now the known noise is
    dropped and any other warning is one `slipstream:` line, once."""
    from slipstream.run import inference

    trace = torch.jit.trace

    def noisy(*args, **kwargs):
        for _ in range(2):
            warnings.warn("a thing torch wants said\nwith a second line", UserWarning, stacklevel=2)
        return trace(*args, **kwargs)

    monkeypatch.setattr(torch.jit, "trace", noisy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inference.export_model(tiny_model(), torch.rand(2, 3, 16, 16), "torchscript", tmp_path / "m.pt")
    assert [str(w.message) for w in caught] == [
        "slipstream: torch warned while exporting: a thing torch wants said"
    ]
