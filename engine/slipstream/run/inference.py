"""A checkpoint after training: evaluated on a dataset, or exported for inference.

Both rebuild the run that wrote the checkpoint from the config it holds (with a
recipe and overrides on top, e.g. other eval data): model, data and the plugins'
model surgery at ``init``, then load the chosen weights (the model's own, or a
plugin's such as the EMA). Plugins that keep weights of their own are left out of
the rebuilt run, so the weights evaluated are the ones chosen.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from slipstream.data.loaders import stop_workers
from slipstream.errors import CheckpointError, ConfigError, ConfigWarning, describe
from slipstream.run.checkpoint import (
    class_mismatch,
    dataset_classes,
    load_checkpoint,
    select_weights,
    weight_problems,
)
from slipstream.run.directory import atomic_write_text, fsync_dir, strict_json, write_failure

# The names of the model's output indices, in an exported file (TorchScript's and
# exported-program's extra files; ONNX metadata key "classes"): a JSON list.
CLASSES_FILE = "classes.json"

FORMATS = ("torchscript", "onnx", "exported-program")
_RECORDING_SERVICES = (
    "engine.metrics",
    "engine.checkpoint",
    "engine.summary",
    "engine.utilization",
    "engine.target",
    "engine.progress",
    "engine.losses",
)


@dataclass
class Rebuilt:
    """A run rebuilt from a checkpoint, its chosen weights loaded."""

    trainer: Any  # slipstream.Trainer
    payload: dict[str, Any]
    weights: str

    @property
    def model(self) -> nn.Module:
        return self.trainer.state.unwrapped_model

    @property
    def eval_geometry(self) -> Any:
        """How the evaluation's images are cut (their size and crop_pct)."""
        from slipstream.data.geometry import geometries
        from slipstream.data.sources import dataset_class

        data = self.trainer.config.get("data") or {}
        return geometries(data, dataset_class(str(data.get("name"))).photos)[1]

    def inputs(self, count: int = 2) -> torch.Tensor:
        """``count`` eval inputs as the model receives them (on the device,
        normalised, in the run's memory format)."""
        from slipstream.services.batches import as_pair, to_device

        state = self.trainer.state
        loader = state.eval_loader if state.eval_loader is not None else state.train_loader
        batch = as_pair(next(iter(loader)))  # a dict batch too
        state.batch = to_device((batch[0][:count], batch[1][:count]), state.device)
        self.trainer.normalize.prepare(state)
        return state.batch[0]


def rebuild(
    checkpoint: str | Path,
    *,
    recipe: str | Path | None = None,
    overrides: Sequence[str] = (),
    weights: str = "model",
    run_dir: str | Path | None = None,
    metrics: Sequence[Any] | None = None,
    purpose: str = "eval",
) -> Rebuilt:
    """The run that wrote ``checkpoint``, rebuilt on this machine with ``weights``
    (``model`` or one that :func:`slipstream.run.checkpoint.weights_in` lists) loaded,
    evaluating ``metrics`` (None: the run's). A checkpoint of a Trainer built in Python
    is rebuilt from what it records (:func:`python_run_config`)."""
    from slipstream.config.schema import build_config, to_dict
    from slipstream.plugins.discovery import algorithm_class, discover
    from slipstream.run.build import build_trainer

    payload = load_checkpoint(checkpoint)
    saved = payload.get("config") or {}
    if not isinstance((saved.get("data") or {}).get("name"), str):
        saved = python_run_config(payload, checkpoint, recipe, overrides, purpose)
    select_weights(payload, weights, checkpoint)  # a missing kind fails before any work
    trainer_saved = dict(saved.get("trainer") or {})
    if str(trainer_saved.get("device", "")).startswith("cuda") and not torch.cuda.is_available():
        # Trained on a GPU, looked at on a machine without one.
        saved = {**saved, "trainer": {**trainer_saved, "device": "auto"}}
    cfg = build_config(recipe, None, list(overrides), base=saved)
    if metrics is not None:
        cfg.evaluation.metrics = list(metrics)
    installed = discover(load=False)
    # The weights are chosen here, not by a plugin swapping its own in at evaluation.
    cfg.algorithms = {
        name: options
        for name, options in to_dict(cfg.algorithms).items()
        if not getattr(algorithm_class(name, installed), "weights", None)
    }
    t = cfg.trainer
    t.run_dir = str(run_dir) if run_dir is not None else tempfile.mkdtemp(prefix="slipstream-eval-")
    t.load_path, t.autoresume, t.overwrite = None, False, False
    t.load_weights_only, t.load_ignore_keys, t.load_weights = False, [], "model"
    t.checkpoint_interval, t.best_metric, t.progress_bar = None, None, False
    t.target_accuracy, t.stop_at_target = None, False
    cfg.model.pretrained = False  # the checkpoint has the weights: no download
    trainer = build_trainer(cfg, label="eval", installed=installed, verbose=False, eval_only=True)
    Path(trainer.run_dir).mkdir(parents=True, exist_ok=True)
    state = trainer.state
    trainer.pm.hook.init(state=state)  # the plugins' model surgery, as in training
    # No run happens: the services that record one (metrics log, checkpoints, summary,
    # clocks) are left out, so evaluating writes nothing but its own result.
    for name in _RECORDING_SERVICES:
        if trainer.pm.has_plugin(name):
            trainer.pm.unregister(name=name)
    from slipstream.run.checkpoint import load_weights

    _check_fit(state.unwrapped_model, select_weights(payload, weights, checkpoint), checkpoint, weights, overrides)
    load_weights(state.unwrapped_model, checkpoint, weights=weights, payload=payload)
    from slipstream.services.nonfinite import nonfinite_names

    bad = nonfinite_names(list(state.unwrapped_model.state_dict().items()))
    if bad:  # any metric or export of them would be NaN, or a number that means nothing
        raise CheckpointError(
            f"the {weights} weights in {checkpoint} are not finite (NaN or infinity in {', '.join(bad[:3])}"
            f"{f' and {len(bad) - 3} more' if len(bad) > 3 else ''}): nothing to evaluate or export; "
            "use an earlier checkpoint of the run"
        )
    state.unwrapped_model.eval()
    return Rebuilt(trainer, payload, weights)


def python_run_config(
    payload: dict[str, Any], checkpoint: Any, recipe: Any, overrides: Sequence[str], purpose: str
) -> dict[str, Any]:
    """The config to rebuild a checkpoint of a Trainer built in Python from: the model
    it names (a timm model's architecture, or ``model.name``/``--model``
    package.module:build from the command line) and, for ``export``, example inputs of
    the size it trained on; ``eval`` needs the data named (its config has none). A
    missing part is a CheckpointError in one line saying what to give."""
    saved = dict(payload.get("config") or {})
    given = {o.split("=", 1)[0].strip() for o in overrides}
    model = dict(saved.get("model") or {})
    name = str(model.get("name") or "")
    if "model.name" not in given and recipe is None and not _buildable(name):
        raise CheckpointError(
            f"checkpoint {checkpoint} was written by a Trainer built in Python around a {name or 'model'} "
            "that slipstream cannot build: give --model package.module:build (a function of num_classes "
            "that returns the model)"
        )
    data: dict[str, Any] = {}
    if purpose == "export" and "data.name" not in given and recipe is None:
        # Example inputs only (the trace's and the check's): synthetic images of the size it trained on.
        shape = payload.get("input_shape") or [3, 32, 32]
        classes = model.get("num_classes") or _classes_in(payload) or 2
        data = {"name": "synthetic", "image_size": int(shape[-1]), "num_classes": int(classes),
                "train_size": 4, "val_size": 4, "batch_size": 2, "num_workers": 0}  # fmt: skip
    elif "data.name" not in given and recipe is None:
        raise CheckpointError(
            f"checkpoint {checkpoint} was written by a Trainer built in Python, whose data it cannot name: "
            "give the eval data, e.g. data.name=imagefolder data.root=DIR (or --recipe)"
        )
    if model.get("num_classes") is None:
        model.pop("num_classes", None)
    trainer = {k: v for k, v in (saved.get("trainer") or {}).items() if k in ("seed", "eval_interval")}
    return {"model": model, "data": data, "trainer": trainer, "algorithms": saved.get("algorithms") or {},
            "evaluation": saved.get("evaluation") or {}}  # fmt: skip


def _buildable(name: str) -> bool:
    """Whether ``model.name`` is one slipstream can build (not a bare class name)."""
    return ":" in name or name.startswith(("timm/", "torchvision/"))


def _classes_in(payload: dict[str, Any]) -> int | None:
    """The class count of a checkpoint: its class names, or the rows of its last matrix."""
    if payload.get("classes"):
        return len(payload["classes"])
    matrices = [v for v in (payload.get("model") or {}).values() if isinstance(v, torch.Tensor) and v.dim() == 2]
    return int(matrices[-1].shape[0]) if matrices else None


def _check_fit(model: nn.Module, saved: Any, checkpoint: Any, weights: str, overrides: Sequence[str]) -> None:
    """Refuse weights that do not fit the rebuilt model, saying what eval and export
    allow: every weight of the checkpoint goes into the model it was trained with (no
    trainer.load_ignore_keys, which leaves weights untrained: a number measured with
    them would be of no trained model)."""
    problems = weight_problems(saved, model.state_dict())
    if not problems:
        return
    changed = [o for o in overrides if o.split("=", 1)[0].startswith(("model.", "data.num_classes"))]
    cause = (
        f"drop the overrides that change the model ({', '.join(changed)})"
        if changed
        else "evaluate it with the model and classes it was trained with"
    )
    raise CheckpointError(
        f"checkpoint {checkpoint}: its {weights} weights do not fit {type(model).__name__}; "
        + "; ".join(problems)
        + f". eval and export load every weight of the checkpoint into the model it was trained with: {cause}; "
        "for another model, fine-tune one from it first (slipstream train trainer.load_path=... "
        "trainer.load_weights_only=true trainer.load_ignore_keys=[...]) and evaluate that run"
    )


def note_weights(payload: Any, weights: str, checkpoint: Any, doing: str) -> None:
    """Warn in one line where ``weights`` are not those the run evaluated with: an EMA
    run's evaluations (and its summary's accuracy) are of its averaged weights, and the
    model's own weights give another number. A plugin that keeps weights evaluates with
    them unless its options say ``eval_with_<kind>: false`` (ema's ``eval_with_ema``)."""
    for name, record in (payload.get("plugins") or {}).items():
        kind = record.get("weights")
        if not kind or kind == weights or not (record.get("state") or {}).get("weights"):
            continue
        if (record.get("config") or {}).get(f"eval_with_{kind}", True) is False:
            continue
        warnings.warn(
            f"slipstream: {doing} the model's own weights of {checkpoint}; the run evaluated with "
            f"its {kind} weights{f' (plugin {name})' if name != kind else ''}, as its summary's accuracy is: "
            f"give --weights {kind} for those",
            stacklevel=3,
        )
        return


def check_classes(trained: Sequence[str] | None, data: Sequence[str] | None, checkpoint: Any) -> None:
    """Refuse, naming the classes, data whose class names differ from those the
    checkpoint's weights were trained on (:func:`slipstream.run.checkpoint.class_mismatch`)."""
    detail = class_mismatch(trained, data, ("data", "checkpoint"))
    if detail is None:
        return
    raise ConfigError(
        f"the evaluation data's classes are not those {checkpoint} was trained on ({detail}); "
        "its accuracy would score each index as another class. Evaluate on data with the same class folders"
    )


def _choose_set(rebuilt: Rebuilt, name: str) -> Any:
    """Leave only evaluation set ``name`` in the rebuilt run (its metrics then under bare
    names); its geometry. An unknown name is a ConfigError listing the sets."""
    from slipstream.data.geometry import geometries
    from slipstream.data.sources import dataset_class, eval_set_configs

    state = rebuilt.trainer.state
    sets = state.eval_sets or {"val": state.eval_loader}
    if name not in sets:
        raise ConfigError(f"--set {name}: the run has no evaluation set of that name; its sets: {', '.join(sets)}")
    state.eval_sets, state.eval_loader = {name: sets[name]}, sets[name]
    described = eval_set_configs(rebuilt.trainer.config.get("data") or {})[name]
    return geometries(described, dataset_class(str(described.get("name"))).photos)[1]


def evaluate_checkpoint(
    checkpoint: str | Path,
    *,
    recipe: str | Path | None = None,
    overrides: Sequence[str] = (),
    weights: str = "model",
    output: str | Path | None = None,
    metrics: Sequence[Any] | None = None,
    eval_set: str | None = None,
) -> dict[str, Any]:
    """Evaluate ``checkpoint`` on its run's eval data (every set of ``data.eval_sets``,
    another set's metrics as ``SET/METRIC``; ``eval_set``: that one alone) (or what ``recipe`` and
    ``overrides`` give: another set, ``data.eval_image_size``, ``data.crop_pct``) and
    return the metrics (``metrics``, or the run's ``evaluation.metrics``: by default
    loss, accuracy, accuracy_top5 with 5 classes or more) with what was evaluated; a
    table metric (confusion_matrix) is in it as a list of rows. Also written to
    ``output`` as JSON."""
    with tempfile.TemporaryDirectory(prefix="slipstream-eval-") as scratch:
        rebuilt = rebuild(
            checkpoint, recipe=recipe, overrides=overrides, weights=weights, run_dir=scratch, metrics=metrics
        )
        state = rebuilt.trainer.state
        if state.eval_loader is None:
            raise ConfigError("slipstream eval: the config gives no eval data")
        geometry = rebuilt.eval_geometry
        if eval_set is not None:
            geometry = _choose_set(rebuilt, eval_set)
        check_classes(rebuilt.payload.get("classes"), dataset_classes(state.eval_loader), checkpoint)
        note_weights(rebuilt.payload, weights, checkpoint, "evaluating")
        try:
            values = rebuilt.trainer.evaluator.evaluate(state)
        finally:  # persistent workers left to the interpreter's exit delay it (data.loaders)
            stop_workers(state.train_loader, state.eval_loader)
        values = dict(state.eval_metrics if not values else values)
    ts = rebuilt.payload.get("timestamp", {})
    result = {
        **{k: float(v) for k, v in values.items()},
        **rebuilt.trainer.evaluator.tables,
        # Counted by the evaluation: a streamed dataset (WebDataset shards) has no len().
        "samples": rebuilt.trainer.evaluator.samples,
        "checkpoint": str(checkpoint),
        "weights": weights,
        "epoch": ts.get("epoch"),
        "batch": ts.get("batch"),
        "data": rebuilt.trainer.config.get("data", {}).get("name"),
        # The evaluation's geometry: its size and the centre crop's share of the shorter side.
        "eval_image_size": geometry.size,
        "crop_pct": geometry.crop_pct,
    }
    sets = list(rebuilt.trainer.state.eval_sets)
    if eval_set is not None or len(sets) > 1:
        result["sets"] = sets  # the first's metrics under bare names, another's as SET/METRIC
    if output is not None:
        atomic_write_text(output, strict_json(result, indent=2) + "\n")
    return result


def export_model(
    model: nn.Module,
    inputs: torch.Tensor,
    format: str,
    output: str | Path,
    *,
    check: bool = True,
    atol: float = 1e-4,
    rtol: float = 1e-3,
    classes: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Write ``model`` (in eval mode) for inference as ``format`` (torchscript: a
    trace; onnx; exported-program: ``torch.export``) to ``output``, then load the
    file and compare its outputs on ``inputs`` with the eager model's. Returns the
    check: max absolute difference and whether it is within ``atol`` + ``rtol``.
    ``classes``, the names of the output indices, go into the file (TorchScript and
    exported-program extra file ``classes.json``; ONNX metadata ``classes``).
    Raises ConfigError for an unknown format or a missing onnx package."""
    if format not in FORMATS:
        raise ConfigError(f"export format {format!r} is not one of {', '.join(FORMATS)}")
    output = Path(output)
    if format == "exported-program" and output.suffix != ".pt2":
        # torch.export.load reads other names only after complaining that they do not end in .pt2
        raise ConfigError(f"an exported-program file ends in .pt2 (torch.export's package format); got {output}")
    model = model.eval()
    with torch.no_grad():
        expected = model(inputs)
    with _warnings_in_one_line(), _replaced_when_done(output) as partial:
        result = _export_and_check(model, inputs, expected, format, partial, check, atol, rtol, classes)
    result["file"] = str(output)
    result["classes"] = list(classes) if classes else None
    return result


# torch's warnings while exporting that tell a user of the CLI nothing to act on: the
# deprecation of the format they chose (torch.jit.trace, save, load), and a note of the
# .pt2 packer about how it groups CPU weights.
_NOISE = ("is deprecated. Please switch to", "No complete tensor found in the group")


@contextmanager
def _warnings_in_one_line() -> Iterator[None]:
    """The warnings raised inside, each once and in one line: slipstream's own as they
    were, a library's as ``slipstream: torch warned while exporting: <its first line>``
    (torch's warnings name a line of torch's source, and run over several lines), and
    the known noise (``_NOISE``) not at all."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        shown: set[str] = set()
        for warning in caught:
            text = str(warning.message)
            ours = text.startswith("slipstream: ") or issubclass(warning.category, ConfigWarning)
            if not ours:
                if any(noise in text for noise in _NOISE):
                    continue
                first = text.strip().splitlines()[0] if text.strip() else warning.category.__name__
                text = f"slipstream: torch warned while exporting: {first}"
            if text not in shown:
                shown.add(text)
                warnings.warn(text, warning.category if ours else UserWarning, stacklevel=3)


@contextmanager
def _replaced_when_done(output: Path) -> Iterator[Path]:
    """A file beside ``output``, with its suffix (the loaders read the format from it),
    that replaces ``output`` only once everything written to it and read back from it
    succeeded: a failed export leaves no partial file and the old one as it was, and a
    write that fails (no permission, a read-only file system, a full disk) says so in
    one line naming ``output`` and the cause, not the partial file."""
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise (write_failure(exc, output) or exc) from None
    while True:
        partial = output.parent / f".{output.stem}.{secrets.token_hex(6)}.partial{output.suffix}"
        try:  # made here, by Python, so that a refusal is an OSError with its errno
            os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666))
            break
        except FileExistsError:
            continue
        except OSError as exc:
            raise (write_failure(exc, output) or exc) from None
    try:
        yield partial
        os.replace(partial, output)
    except Exception as exc:
        _remove(partial)
        failure = write_failure(exc, output, _size(partial))
        if failure is None:
            raise
        raise failure from None
    except BaseException:
        _remove(partial)
        raise
    fsync_dir(output.parent)


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:  # a file system turned read-only: the failure that led here is the one to report
        pass


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


class _Recording(io.BufferedWriter):
    """A file that remembers the OSError its writes raised: torch's zip writer turns
    one into ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos``,
    which names no cause. A real file object (seekable), as torch.export wants."""

    error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return super().write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        try:
            super().flush()
        except OSError as exc:
            self.error = exc
            raise


def _write(path: Path, save: Callable[[IO[bytes]], Any]) -> None:
    """``save(file)`` into ``path`` through a Python file object. torch's writers given a
    path write it in C++, where a full disk aborts the whole process
    (``terminate called after throwing an instance of 'c10::Error'``, exit 134) and
    leaves the partial file; through a file object the failed write is an OSError
    naming its cause, raised here even where torch wraps it in an error of its own."""
    with _Recording(io.FileIO(path, "wb")) as file:
        try:
            save(file)
            file.flush()
            os.fsync(file.fileno())
        except Exception as exc:
            if file.error is not None and file.error is not exc:
                raise file.error from None
            raise


def _export_and_check(
    model: nn.Module,
    inputs: torch.Tensor,
    expected: Any,
    format: str,
    output: Path,
    check: bool,
    atol: float,
    rtol: float,
    classes: Sequence[str] | None = None,
) -> dict[str, Any]:
    extra = {CLASSES_FILE: json.dumps(list(classes))} if classes else {}
    if format == "torchscript":
        any_batch = True  # a trace of convolutions and matmuls keeps the batch dimension free
        with torch.no_grad():
            traced = torch.jit.trace(model, (inputs,), check_trace=False)
        _write(output, lambda f: torch.jit.save(traced, f, _extra_files=extra))
        run = torch.jit.load(str(output), map_location=inputs.device)
    elif format == "exported-program":
        program, any_batch = _with_any_batch(
            lambda dynamic: torch.export.export(model, (inputs,), dynamic_shapes=dynamic), len(inputs)
        )
        _write(output, lambda f: torch.export.save(program, f, extra_files=extra))
        run = torch.export.load(str(output)).module()
    else:
        run, any_batch = _export_onnx(model, inputs, output, extra.get(CLASSES_FILE))
    result: dict[str, Any] = {
        "format": format,
        "file": str(output),
        "input_shape": list(inputs.shape),
        "any_batch_size": any_batch,
    }
    if not check:
        return result
    result["max_abs_diff"], result["matches"] = _compare(run, inputs, expected, atol, rtol)
    if any_batch and len(inputs) > 1:
        # The batch size is free (a trace and the dynamic export keep it so): shown on one sample.
        with torch.no_grad():
            one = model(inputs[:1])
        diff, matches = _compare(run, inputs[:1], one, atol, rtol)
        result["max_abs_diff"] = max(result["max_abs_diff"], diff)
        result["matches"] = result["matches"] and matches
    return result


def _compare(run: Any, inputs: torch.Tensor, expected: Any, atol: float, rtol: float) -> tuple[float, bool]:
    """The exported model's largest difference from the eager outputs, and whether it is
    within tolerance."""
    with torch.no_grad():
        got = run(inputs)
    got = got[0] if isinstance(got, (tuple, list)) else got
    expected = expected[0] if isinstance(expected, (tuple, list)) else expected
    got = torch.as_tensor(got).to(expected.device, expected.dtype)
    diff = (got - expected).abs().max().item() if expected.numel() else 0.0
    return diff, bool(torch.allclose(got, expected, atol=atol, rtol=rtol))


def _with_any_batch(export: Any, batch: int) -> tuple[Any, bool]:
    """``export(dynamic_shapes)`` with the batch dimension left free (exported at the
    example's size alone, the model took no other batch size), and whether it is free;
    a model that cannot be exported so is exported for ``batch``, with a warning."""
    try:
        return export(({0: torch.export.Dim.DYNAMIC},)), True
    except Exception as exc:  # torch.export's refusals have many types
        warnings.warn(
            f"slipstream: the model cannot be exported for any batch size ({describe(exc)}); the file "
            f"takes batches of {batch} only",
            stacklevel=3,
        )
        return export(None), False


def _export_onnx(model: nn.Module, inputs: torch.Tensor, output: Path, classes: str | None) -> tuple[Any, bool]:
    try:
        import onnx  # noqa: F401
        import onnxruntime
    except ImportError as exc:
        raise ConfigError(
            f"export --format onnx needs onnx and onnxruntime ({exc}); install them with: "
            "pip install 'slipstream[onnx]'"
        ) from None
    program, any_batch = _with_any_batch(
        lambda dynamic: torch.onnx.export(model, (inputs,), dynamo=True, verbose=False, dynamic_shapes=dynamic),
        len(inputs),
    )
    if classes is not None:
        program.model.metadata_props["classes"] = classes  # JSON, as in the other formats' classes.json
    program.save(str(output))
    session = onnxruntime.InferenceSession(str(output), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(session.run(None, {name: x.detach().cpu().contiguous().numpy()})[0])

    return run, any_batch


def export_checkpoint(
    checkpoint: str | Path,
    format: str,
    output: str | Path,
    *,
    recipe: str | Path | None = None,
    overrides: Sequence[str] = (),
    weights: str = "model",
    check: bool = True,
) -> dict[str, Any]:
    """Export the model of ``checkpoint`` as :func:`export_model` does, with each
    plugin's model surgery kept or undone as the plugin declares
    (``Plugin.export_model``), in fp32 on the CPU, checked on a batch of eval inputs
    (normalised as in training: the exported model expects normalised inputs, whose
    mean and std the result gives)."""
    if format not in FORMATS:
        raise ConfigError(f"export format {format!r} is not one of {', '.join(FORMATS)}")
    with tempfile.TemporaryDirectory(prefix="slipstream-export-") as scratch:
        rebuilt = rebuild(
            checkpoint,
            recipe=recipe,
            overrides=[*overrides, "trainer.device=cpu"],
            weights=weights,
            run_dir=scratch,
            purpose="export",
        )
        note_weights(rebuilt.payload, weights, checkpoint, "exporting")
        model = rebuilt.model.float()
        for plugin in reversed(rebuilt.trainer.algorithms):
            model = plugin.export_model(model)
        inputs = rebuilt.inputs().float()
        classes = rebuilt.payload.get("classes")
        result = export_model(model, inputs, format, output, check=check, classes=classes)
    normalize = rebuilt.trainer.normalize
    result.update(
        checkpoint=str(checkpoint),
        weights=weights,
        algorithms=[a.name for a in rebuilt.trainer.algorithms],
        mean=_floats(getattr(normalize, "mean", None)),
        std=_floats(getattr(normalize, "std", None)),
    )
    if check and not result["matches"]:
        raise CheckpointError(
            f"the {format} export in {output} does not match the eager model on a batch "
            f"(max |difference| {result['max_abs_diff']:.3g})"
        )
    return result


def _floats(value: Any) -> list[float] | None:
    if value is None:
        return None
    return [float(v) for v in torch.as_tensor(value).flatten().tolist()]
