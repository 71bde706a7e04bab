"""The engine's one CPU-kind detector (slipstream.cpu_kind) and SLIPSTREAM_CPU_KIND,
which makes the engine act as another kind (docs/contributing.md)."""

from __future__ import annotations

import pytest

from helpers import TINY_RUN, error_lines
from slipstream import ConfigError, cpu_kind, native_bf16
from slipstream.cli.main import main
from slipstream.services.cpu_kind import ENV, KINDS, describe_cpu_kind, detected_cpu_kind


@pytest.mark.parametrize(("kind", "native"), [("avx2", False), ("avx512", False), ("avx512_bf16", True), ("amx", True)])
def test_the_override_is_the_kind_the_engine_acts_on(monkeypatch, kind, native):
    real = detected_cpu_kind()
    monkeypatch.setenv(ENV, kind)
    assert cpu_kind() == kind and native_bf16() is native
    assert detected_cpu_kind() == real  # what only the hardware can show ignores it
    assert describe_cpu_kind() == kind if real == kind else describe_cpu_kind().startswith(f"{kind} (as {ENV} says")
    monkeypatch.delenv(ENV)
    assert cpu_kind() == real in KINDS


def test_a_bad_override_is_one_line_naming_the_kinds(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(ENV, "avx1024")
    allowed = "allowed: avx2, avx512, avx512_bf16, amx"
    with pytest.raises(ConfigError, match=f"{ENV}='avx1024' is not a CPU kind; {allowed}"):
        cpu_kind()
    run_dir = tmp_path / "run"
    code = main(["train", "-q", *TINY_RUN, "trainer.max_duration=1ba", f"trainer.run_dir={run_dir}"])
    err = error_lines(capsys.readouterr().err)
    assert code == 2 and len(err) == 1 and "is not a CPU kind" in err[0], err
    assert not (run_dir / "checkpoints").exists()
