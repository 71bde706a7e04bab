"""One run set-up for the CLI and the Python API (TrainerOptions), and the README's
Python example, run as written (with small sizes)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from helpers import Probe, tiny_loaders, tiny_model, train
from slipstream import ConfigError, Trainer, to_unit_float
from slipstream.config.options import TrainerOptions
from slipstream.config.schema import build_config
from slipstream.data import DATASET_STATS, SyntheticShapes
from slipstream.run.build import build_trainer

README = Path(__file__).parents[1] / "README.md"


def test_log_interval_zero_is_a_clear_error(tmp_path):
    model = tiny_model()
    with pytest.raises(ConfigError, match="log_interval must be at least 1"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loaders()[0],
                run_dir=tmp_path / "run", device="cpu", log_interval=0)
    assert not (tmp_path / "run").exists()


def test_checkpoint_interval_none_writes_no_checkpoint(tmp_path):
    off = train(tmp_path / "off", [], max_duration="1ep", checkpoint_interval=None)
    assert not (off.run_dir / "checkpoints").exists()
    on = train(tmp_path / "on", [], max_duration="1ep")
    assert (on.run_dir / "checkpoints" / "latest.pt").exists()


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_eval_interval_none_means_no_evaluation_at_all(tmp_path):
    off = train(tmp_path / "off", [], max_duration="1ep", eval_interval=None)
    assert not [r for r in _records(off.run_dir) if r["kind"] == "eval"]
    assert off.summary["accuracy"] is None
    on = train(tmp_path / "on", [], max_duration="1ep")
    assert [r["kind"] for r in _records(on.run_dir)].count("eval") == 1
    # The CLI says it the same way.
    cfg = build_config(None, None, ["trainer.eval_interval=null", "trainer.checkpoint_interval=null"])
    options = TrainerOptions.from_config(cfg.trainer)
    assert options.eval_interval is None and options.checkpoint_interval is None


def test_the_trainer_seeds_as_the_cli_does(tmp_path):
    runs = iter(range(100))

    def first_draw(seed: int, disturb: int) -> torch.Tensor:
        torch.manual_seed(disturb)  # whatever the process did before
        drawn = []
        probe = Probe(fit_start=lambda state: drawn.append(torch.rand(3)))
        train(tmp_path / str(next(runs)), [probe], max_duration="1ba", seed=seed)
        return drawn[0]

    assert torch.equal(first_draw(3, 0), first_draw(3, 99))
    assert not torch.equal(first_draw(3, 0), first_draw(4, 0))


def test_the_trainer_sets_threads(tmp_path):
    torch.set_num_threads(2)
    train(tmp_path / "one", [], max_duration="1ba", threads=1)
    assert torch.get_num_threads() == 1
    train(tmp_path / "default", [], max_duration="1ba")  # None leaves them alone
    assert torch.get_num_threads() == 1


def test_normalize_auto_uses_the_dataset_statistics(tmp_path, capsys):
    def first_inputs(loader, **kwargs) -> torch.Tensor:
        seen = []
        probe = Probe(before_forward=lambda state: seen.append(state.batch[0].clone()))
        model = tiny_model(num_classes=10)
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                max_duration="1ba", algorithms=[probe], run_dir=tmp_path / f"r{len(list(tmp_path.iterdir()))}",
                device="cpu", progress_bar=False, eval_interval=None, **kwargs).fit()
        return seen[0]

    shapes = DataLoader(SyntheticShapes(32, image_size=16), batch_size=16)
    raw = to_unit_float(next(iter(shapes))[0])  # the dataset's uint8 as float in [0, 1]
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in DATASET_STATS["synthetic"])
    torch.testing.assert_close(first_inputs(shapes), (raw - mean) / std)
    torch.testing.assert_close(first_inputs(shapes, normalize=None), raw)
    # A dataset it does not know: left as it is, and said so.
    unknown = tiny_loaders()[0]
    torch.testing.assert_close(first_inputs(unknown), next(iter(unknown))[0])
    assert "inputs are not normalised: no known mean/std for a TensorDataset" in capsys.readouterr().err


def test_a_python_run_writes_config_yaml(tmp_path):
    trainer = train(tmp_path, [], max_duration="1ba", seed=5)
    config = yaml.safe_load((trainer.run_dir / "config.yaml").read_text())
    # A timm model by its architecture: what `slipstream eval` and `export` build again (issue 43).
    assert config["model"]["name"] == "timm/test_resnet" and config["optimizer"]["name"] == "SGD"
    assert config["trainer"]["seed"] == 5 and config["trainer"]["max_duration"] == "1ba"


def test_the_cli_builds_the_same_options(tmp_path):
    cfg = build_config(None, None, [
        "model.name=test_resnet", "data.train_size=32", "data.val_size=16", "data.image_size=16",
        "trainer.seed=11", "trainer.threads=1", "trainer.log_interval=3", "trainer.eval_interval=null",
        f"trainer.run_dir={tmp_path / 'run'}",
    ])
    options = build_trainer(cfg, verbose=False).options
    assert (options.seed, options.threads, options.log_interval, options.eval_interval) == (11, 1, 3, None)
    assert options.normalize == DATASET_STATS["synthetic"]


def _readme_python_example() -> str:
    text = README.read_text()
    section = text[text.index("## Python API"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README's Python API section has no python code block"
    return match.group(1)


def test_the_readme_python_example_runs(tmp_path, monkeypatch):
    code = _readme_python_example()
    # Small sizes, so that the example runs in seconds; each must be in the text.
    for old, new in {
        '"resnet18"': '"test_resnet"',
        "SyntheticShapes(512, image_size=32": "SyntheticShapes(64, image_size=16",
        "SyntheticShapes(256, image_size=32": "SyntheticShapes(32, image_size=16",
        "threads=2": "threads=1",
    }.items():
        assert old in code, old
        code = code.replace(old, new)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["summary"]["status"] == "completed"
    assert namespace["summary"]["accuracy"] is not None
    assert (tmp_path / "runs" / "mine" / "config.yaml").exists()


def test_deterministic_warns_on_cuda_and_refuses_on_cpu(monkeypatch):
    # On CUDA torch has no deterministic-flagged kernel for the global average pool's
    # backward (every timm and torchvision CNN): strict mode would stop such a run at its
    # first step, so CUDA runs warn; the CPU keeps the strict mode.
    import os

    from slipstream.run.process import apply_process_settings

    calls = []

    def record(mode, warn_only=False):
        calls.append((mode, warn_only))

    monkeypatch.setattr(torch, "use_deterministic_algorithms", record)
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"})
    apply_process_settings(TrainerOptions(deterministic=True), torch.device("cuda"))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"  # cuBLAS's deterministic workspace
    apply_process_settings(TrainerOptions(deterministic=True), torch.device("cpu"))
    assert calls == [(True, True), (True, False)]


# -- one definition of the trainer settings (issue 24 §3) -----------------------------


def _settings() -> dict[str, object]:
    import dataclasses

    return {f.name: f for f in dataclasses.fields(TrainerOptions)}


def test_the_config_schema_follows_the_trainer_options():
    # Every setting with a config key has it, with the Python API's default; the
    # schema has no key of its own.
    defaults = OmegaConf.to_container(build_config(None, None, []).trainer)
    config_settings = {n: f for n, f in _settings().items() if not f.metadata["api_only"]}
    assert set(defaults) == set(config_settings)
    for name, f in config_settings.items():
        expected = f.default if not isinstance(f.default, tuple) else list(f.default)
        if name == "ddp":
            assert defaults["ddp"] == {"bucket_cap_mb": None, "static_graph": False, "find_unused_parameters": False}
        else:
            assert defaults[name] == expected, name
    # and omegaconf checks the type the option declares for its YAML value
    with pytest.raises(ConfigError, match="trainer.log_interval"):
        build_config(None, None, ["trainer.log_interval=often"])


def test_the_trainer_keywords_follow_the_trainer_options():
    import inspect

    params = inspect.signature(Trainer).parameters
    for name, f in _settings().items():
        assert name in params, name
        assert params[name].default == f.default, name


def test_a_misspelled_trainer_keyword_is_a_clear_error(tmp_path):
    model = tiny_model()
    with pytest.raises(ConfigError, match="unknown setting 'log_intervall'.*did you mean 'log_interval'"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loaders()[0],
                run_dir=tmp_path / "run", log_intervall=5)
    with pytest.raises(ConfigError, match="options= or as keywords, not both"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loaders()[0],
                options=TrainerOptions(), seed=3)
    assert not (tmp_path / "run").exists()


def test_the_cli_applies_process_settings_once(tmp_path, monkeypatch):
    calls = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), real(n)))
    cfg = build_config(None, None, [
        "model.name=test_resnet", "data.train_size=32", "data.val_size=16", "data.image_size=16",
        "trainer.threads=1", "trainer.seed=7", f"trainer.run_dir={tmp_path / 'run'}",
    ])
    build_trainer(cfg, verbose=False)
    assert calls == [1]
    # Seeding is not a process setting: the CLI seeds before it builds data and model,
    # and the Trainer again, so that training starts from the seed as a Python run does.
    after_build = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(after_build, torch.rand(3))


def test_one_train_validates_the_trainer_settings_once_and_reads_its_checkpoint_once(tmp_path, monkeypatch):
    """Issue 40: `slipstream train` validated TrainerOptions three times (the config, the
    command's builder, the Trainer) and an autoresumed run read latest.pt twice (the
    config check, then the restore)."""
    from slipstream.cli.main import main
    from slipstream.run import checkpoint

    validated, read = [], []
    validate, load = TrainerOptions.validate, checkpoint.load_checkpoint
    monkeypatch.setattr(
        TrainerOptions, "validate", lambda self, prefix="": validated.append(prefix) or validate(self, prefix)
    )
    monkeypatch.setattr(
        checkpoint, "load_checkpoint", lambda path, *a, **k: read.append(Path(path).name) or load(path, *a, **k)
    )
    run = ["train", "-q", "model.name=test_resnet", "data.train_size=32", "data.val_size=16", "data.image_size=16",
           "data.batch_size=8", "trainer.checkpoint_interval=2ba", "trainer.autoresume=true",
           "trainer.eval_interval=null", "trainer.autotune=false", f"trainer.run_dir={tmp_path / 'run'}"]  # fmt: skip
    assert main([*run, "trainer.max_duration=2ba"]) == 0
    assert validated == ["trainer."] and read == []
    validated.clear()
    assert main([*run, "trainer.max_duration=4ba"]) == 0  # continues from latest.pt
    assert validated == ["trainer."] and read == ["latest.pt"]


def test_one_train_reads_each_plugin_group_once(tmp_path, monkeypatch):
    """Issue 40: the config, the plugins and the data each discovered the installed
    plugins again (the datasets four times per `slipstream train`)."""
    from collections import Counter

    from slipstream.cli.main import main
    from slipstream.plugins import discovery

    read, entry_points = Counter(), discovery._entry_points
    monkeypatch.setattr(
        discovery, "_entry_points",
        lambda group, base: read.update([group]) or entry_points(group, base)
    )
    assert main(["train", "-q", "--algorithms", "ema", "--callbacks", "early_stopping", "model.name=test_resnet",
                 "data.train_size=32", "data.val_size=16", "data.image_size=16", "data.batch_size=8",
                 "trainer.max_duration=1ba", "trainer.autotune=false", f"trainer.run_dir={tmp_path}"]) == 0  # fmt: skip
    # The default metrics are the engine's own, found without the entry points.
    assert read == {"slipstream.algorithms": 1, "slipstream.callbacks": 1, "slipstream.datasets": 1}


def test_the_run_specification_is_what_was_validated():
    """Issue 40: the command's config is read-only once validated; build_config still
    gives its caller a copy to adjust (eval and export do)."""
    from omegaconf.errors import ReadonlyConfigError

    from slipstream.config.schema import build_config, build_run

    spec = build_run(None, None, ["trainer.seed=3"])
    assert spec.options.validated and spec.options.seed == 3
    with pytest.raises(ReadonlyConfigError):
        spec.config.trainer.seed = 4
    cfg = build_config(None, None, ["trainer.seed=3"])
    cfg.trainer.seed = 4
    assert cfg.trainer.seed == 4
