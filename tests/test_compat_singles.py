"""The compatibility matrix, part 1 (one run of it per session): every installed
algorithm alone on the tiny CNN and ViT with its probe, each with adamw and adafactor,
the design card's five together; and docs/compatibility.md is what the code renders.
Part 2 (pairs) and 3 (DDP, fsdp) are their own files, so xdist can spread them."""

import pytest

from compat_setup import COMMAND, DOC, FIVE, PROBES, SETTINGS, classes
from helpers import error_lines
from slipstream.cli.compatibility import (
    MODELS,
    OPTIMIZERS,
    WRAP_PLUGIN,
    Combo,
    cells_of,
    from_cells,
    render,
    run_local,
)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    # Within the test budget: the resume check for each plugin alone (sgd) and the five;
    # with adamw and adafactor it trains and shows its effect (the CLI checks them all).
    return run_local(classes(tested=True), tmp_path_factory.mktemp("compat"), five=FIVE, settings=SETTINGS,
                     probes=PROBES, parts=("singles", "optimizers", "five"), resume=lambda c: c.optimizer == "sgd")


@pytest.fixture(scope="module")
def committed():
    return cells_of(DOC.read_text())


def test_every_plugin_alone_works_on_a_model_it_applies_to(matrix):
    found = classes()
    assert len(found) >= 17 and "step_timer" in found  # 16 built in, and the third-party example
    for name in matrix.names:
        if name == WRAP_PLUGIN:
            continue
        cells = matrix.single(name)
        assert not [c for c in cells.values() if c.outcome == "failed"], (name, cells)
        assert matrix.models_for(name), (name, cells)
        for kind, cell in cells.items():  # a refusal is one line that names the plugin
            if cell.outcome == "refused":
                assert name in cell.detail and "\n" not in cell.detail, (name, kind, cell)


def test_each_optimizer_at_impl_auto(matrix):
    for name in matrix.names:
        if name == WRAP_PLUGIN:
            continue
        kind = matrix.models_for(name)[0]
        for optimizer in OPTIMIZERS[1:]:
            cell = matrix.cells[Combo((name,), optimizer=optimizer, model=kind)]
            assert cell.outcome == "works", (name, optimizer, cell)


def test_the_five_together_show_every_effect_and_resume_exactly(matrix):
    cell = matrix.cells[Combo(FIVE, model="cnn")]
    assert cell.outcome == "works", cell


def test_the_table_records_these_cells(matrix, committed):
    mine = {c.label: [cell.outcome, cell.detail] for c, cell in matrix.cells.items()}
    assert {k: v for k, v in committed.items() if k in mine} == mine
    assert set(mine) <= set(committed), "regenerate docs/compatibility.md (command in its header)"


def test_the_table_is_what_the_code_renders(committed):
    text = DOC.read_text()
    assert COMMAND in text
    rendered = render(from_cells(committed, classes(), FIVE, SETTINGS), COMMAND)
    assert rendered == text, "regenerate docs/compatibility.md with the command in its header"
    assert set(MODELS) == {"cnn", "vit"}


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--check"], "--check compares with --out PATH"),
        (["--set", "mixed_precision.dtype=bf16"], "expected algorithms.NAME.KEY=VALUE"),
        (["--algorithms", "channels_lats"], "no installed algorithm 'channels_lats'"),
        (["--add", "nowhere.py:Thing"], "expected PATH/TO/module.py:ClassName"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(argv, says, capsys, tmp_path):
    from slipstream.cli.main import main

    assert main(["compatibility", *argv, "--no-distributed"]) == 2
    err = capsys.readouterr().err
    assert says in err and len(error_lines(err)) == 1, err
