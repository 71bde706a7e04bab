"""The compatibility matrix, part 3: under 2-process DDP and under fsdp (gloo), each
plugin with a hook where the wrap matters, fsdp alone, and the five together, all in
one torchrun launch. Which model each plugin applies to comes from the committed table
(part 1 checks those cells). See test_compat_singles.py."""

import pytest
import torch.distributed as dist

from compat_setup import ADD, DOC, FIVE, ROOT, SETTINGS, classes
from slipstream.cli.compatibility import (
    EPOCH_BATCHES,
    Combo,
    cells_of,
    distributed_combos,
    from_cells,
    run_distributed,
)

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    committed = cells_of(DOC.read_text())
    singles = {k: v for k, v in committed.items() if k.count("+") == 0 and k.count("/") == 2}
    matrix = from_cells(singles, classes(tested=True), FIVE, SETTINGS)
    # The resume check under fsdp (sharded state); DDP's state is one process's.
    # The others train one epoch (no probes run here: a cell is whether it trains).
    run_distributed(matrix, tmp_path_factory.mktemp("compat"), extra=[str(ROOT / a) for a in ADD],
                    resume=lambda c: c.wrap == "fsdp", batches=EPOCH_BATCHES)
    return matrix, committed


def test_each_plugin_and_the_five_under_ddp_and_fsdp(launched):
    matrix, _ = launched
    combos = distributed_combos(matrix)
    assert any(c.wrap == "ddp" for c in combos) and any(c.wrap == "fsdp" for c in combos)
    assert Combo((*FIVE, "fsdp"), model="cnn", wrap="fsdp") in combos
    for combo in combos:
        assert matrix.cells[combo].outcome in ("works", "refused"), (combo.label, matrix.cells[combo])


def test_the_table_records_these_cells(launched):
    matrix, committed = launched
    mine = {c.label: [cell.outcome, cell.detail] for c, cell in matrix.cells.items() if c.wrap}
    assert {k: v for k, v in committed.items() if k in mine} == mine
    assert set(mine) <= set(committed), "regenerate docs/compatibility.md (command in its header)"
