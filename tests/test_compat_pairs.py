"""The compatibility matrix, part 2: every pair of installed algorithms (one process),
each with both plugins' probes, or refused by a declaration
that names both. See test_compat_singles.py."""

import pytest

from compat_setup import DOC, FIVE, PROBES, SETTINGS, classes
from slipstream.cli.compatibility import EPOCH_BATCHES, WRAP_PLUGIN, cells_of, pair_cell, run_local


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    # Trained with both probes for one epoch; the resume check (and its second epoch) is
    # left to the CLI's run of the table (each plugin's own resume is checked alone, in
    # part 1), to stay within the budget.
    return run_local(classes(tested=True), tmp_path_factory.mktemp("compat"), five=FIVE, settings=ONE_EPOCH,
                     probes=PROBES, parts=("pairs",), resume=lambda c: False, batches=EPOCH_BATCHES)


# What one epoch needs for every probe to see its plugin act (the table's runs have two):
# swa averages once an epoch from 0.7 of the run by default: in one epoch, never.
ONE_EPOCH = {**SETTINGS, "swa": {"swa_start": "0.3dur", "update_interval": "1ba"}}


def test_every_pair_works_or_is_refused_naming_both(matrix):
    local = [n for n in matrix.names if n != WRAP_PLUGIN]
    seen = 0
    for i, a in enumerate(local):
        for b in local[i + 1 :]:
            cell = pair_cell(matrix, a, b)
            assert cell is not None and cell.outcome != "failed", (a, b, cell)
            if cell.outcome == "refused":
                assert a in cell.detail and b in cell.detail and "\n" not in cell.detail, (a, b, cell)
            seen += cell.outcome == "works"
    assert seen >= len(local) * (len(local) - 1) // 2 - 10  # nearly all pairs train together


def test_the_table_records_these_cells(matrix):
    committed = cells_of(DOC.read_text())
    pairs = {c.label: [cell.outcome, cell.detail] for c, cell in matrix.cells.items() if len(c.names) == 2}
    assert {k: v for k, v in committed.items() if k in pairs} == pairs
    assert set(pairs) <= set(committed), "regenerate docs/compatibility.md (command in its header)"


def test_a_pair_with_a_plugin_that_fails_alone_is_a_failure_not_n_a():
    """n/a means a plugin declared it does not suit a model; a plugin that broke on its
    own makes its pairs untried, which the grid must not pass off as n/a."""
    from slipstream.cli.compatibility import MODELS, Cell, Combo, Matrix, pair_cell

    matrix = Matrix(names=["broken", "fine", "cnn_only"], five=())
    for kind in MODELS:
        matrix.cells[Combo(("broken",), model=kind)] = Cell("failed", "ValueError: oops")
        matrix.cells[Combo(("fine",), model=kind)] = Cell("works")
        matrix.cells[Combo(("cnn_only",), model=kind)] = Cell("works" if kind == "cnn" else "refused", "no ViT")
    matrix.cells[Combo(("fine", "cnn_only"), model="cnn")] = Cell("works")
    cell = pair_cell(matrix, "broken", "fine")
    assert cell.outcome == "failed" and "broken failed on its own" in cell.detail
    assert pair_cell(matrix, "fine", "cnn_only").outcome == "works"
    declined = Matrix(names=["vit_only", "cnn_only"], five=(), cells=dict(matrix.cells))
    for kind in MODELS:
        declined.cells[Combo(("vit_only",), model=kind)] = Cell("works" if kind != "cnn" else "refused", "no CNN")
    assert pair_cell(declined, "vit_only", "cnn_only").outcome == "not_applicable"
