"""profiler: torch.profiler over the configured steps, a Chrome/Perfetto trace and a
table of the top ops in RUN_DIR/profiler/."""

from __future__ import annotations

import json
import warnings

from slipstream_profiler import Profiler, ProfilerConfig

from helpers import train


def test_trace_and_top_ops_table(tmp_path, capsys):
    config = ProfilerConfig(wait=1, warmup=1, active=2, record_shapes=True)
    trainer = train(tmp_path, callbacks=[Profiler(config)], max_duration="6ba", eval_interval=None)
    folder = trainer.run_dir / "profiler"
    (trace,) = folder.glob("trace-step*.json")
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("aten::") for n in names)
    # Two active steps recorded: the profiler's step markers say which.
    assert sum(n.startswith("ProfilerStep#") for n in names) == 2
    table = (folder / "top_ops.txt").read_text()
    assert "aten::" in table and "Self CPU" in table
    assert "aten::" in capsys.readouterr().err  # printed too


def test_a_run_too_short_to_record_warns_and_writes_no_trace(tmp_path):
    config = ProfilerConfig(wait=3, warmup=1, active=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = train(tmp_path, callbacks=[Profiler(config)], max_duration="2ba", eval_interval=None)
    assert not list((trainer.run_dir / "profiler").glob("trace-*.json"))
    assert any("before any were recorded" in str(w.message) for w in caught)
