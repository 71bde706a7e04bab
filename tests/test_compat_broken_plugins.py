"""Broken plugins that `slipstream compatibility` (and a run) must not pass: a plugin
that does not load, has no name, takes an installed plugin's name or marks a method
that is no hook; a step of the wrong type; an exception that must name its plugin; and
state kept in memory across an epoch boundary, which the resume check must catch."""

import json
import textwrap

import pytest
import torch

from helpers import error_lines, train
from slipstream import Algorithm, PluginError, hookimpl
from slipstream.cli.compatibility import RESUME_AT, Combo, check_combo

PLUGINS = textwrap.dedent(
    """
    from slipstream import Algorithm, hookimpl


    class Typo(Algorithm):
        name = "typo"

        @hookimpl
        def after_backwards(self, state):
            pass


    class NoName(Algorithm):
        @hookimpl
        def after_backward(self, state):
            pass


    class Clash(Algorithm):
        name = "ema"


    class Fine(Algorithm):
        name = "fine"
    """
)


def _compatibility(capsys, *argv: str) -> tuple[int, list[str]]:
    from slipstream.cli.main import main

    code = main(["compatibility", "--algorithms", "ema", "--no-distributed", *argv])
    return code, error_lines(capsys.readouterr().err)


@pytest.fixture
def plugin_file(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(PLUGINS)
    return path


@pytest.mark.parametrize(
    ("cls", "says"),
    [
        ("Typo", "plugin 'typo' (Typo) marks method 'after_backwards' as a hook, but there is no hook "
                 "'after_backwards' (did you mean 'after_backward'?)"),
        ("NoName", "NoName has no name; set the class attribute `name`"),
        ("Clash", "Clash is named 'ema', the name of an installed algorithm (distribution slipstream-ema)"),
    ],
)
def test_issue44_case10_add_of_a_broken_plugin_fails_in_one_line(cls, says, plugin_file, capsys):
    """issue 44, case 10: a hook-name typo, a missing name or an installed plugin's name
    in an --add plugin exits 2 with one line saying it, before anything trains (it
    exited 0, with cells 'refused', a blank row, or the installed plugin replaced)."""
    code, lines = _compatibility(capsys, "--add", f"{plugin_file}:{cls}")
    assert code == 2 and len(lines) == 1 and says in lines[0], lines


def test_issue44_case10_every_problem_is_one_line(plugin_file, tmp_path, capsys):
    """issue 44, case 10: several broken plugins, one line each (a file that does not
    import among them), and the exit is non-zero."""
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    code, lines = _compatibility(
        capsys, "--add", f"{plugin_file}:Typo", "--add", f"{plugin_file}:NoName", "--add", f"{plugin_file}:Clash",
        "--add", f"{broken}:Thing", "--add", f"{plugin_file}:Fine",
    )
    assert code == 2 and len(lines) == 4, lines
    assert any("does not load: ModuleNotFoundError: No module named 'not_a_module_anywhere'" in x for x in lines)
    assert not any("'fine'" in line for line in lines)


class SaysNo(Algorithm):
    name = "says_no"

    @hookimpl
    def should_step(self, state):
        return "no"


class FloatLoss(Algorithm):
    name = "float_loss"

    @hookimpl
    def compute_loss(self, state):
        return state.loss_fn(state.outputs, state.batch[1]).item()


class WrapsToFloat(Algorithm):
    name = "wraps_to_float"

    @hookimpl(wrapper=True)
    def compute_loss(self, state):
        loss = yield
        return loss.item()


@pytest.mark.parametrize(
    ("plugin", "says"),
    [
        (SaysNo(), "plugin 'says_no' replaces the 'should_step' step and returned a str ('no'); "
                   "'should_step' must return True or False"),
        (FloatLoss(), "plugin 'float_loss' replaces the 'compute_loss' step and returned a float ("),
        (WrapsToFloat(), "plugin 'wraps_to_float' wraps the 'compute_loss' step and returned a float ("),
    ],
    ids=["should_step-str", "compute_loss-float", "compute_loss-wrapper-float"],
)
def test_issue44_case10_a_step_result_of_the_wrong_kind_is_an_error_naming_the_plugin(plugin, says, tmp_path):
    """issue 44, case 10: should_step returning "no" stepped as if True, and a float loss
    was an AttributeError naming neither plugin nor step; the engine checks what a
    plugin's step returns, in training as in the compatibility command."""
    with pytest.raises(PluginError) as caught:
        train(tmp_path, [plugin], max_duration="1ba")
    message = str(caught.value)
    assert says in message and "\n" not in message, message
    if "compute_loss" in says:
        assert "'compute_loss' must return a scalar tensor" in message
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and says in summary["error"]


class Raises(Algorithm):
    name = "raises"

    @hookimpl
    def after_backward(self, state):
        raise ValueError("boom")


class Wraps(Algorithm):
    name = "wraps"

    @hookimpl(wrapper=True)
    def forward(self, state):
        return (yield)


class BrokenModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)

    def forward(self, x):
        raise RuntimeError("the model broke")


@pytest.mark.filterwarnings("ignore:slipstream. cannot count")
def test_issue44_case10_an_exception_in_a_hook_names_the_plugin_and_hook(tmp_path):
    """issue 44, case 10: summary.json's error (and the traceback's last line, and a
    compatibility cell) name the plugin and the hook that raised; an error of the
    model under a plugin's wrapper is not blamed on the plugin."""
    with pytest.raises(ValueError, match="boom") as caught:
        train(tmp_path, [Raises()], max_duration="1ba")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["error"] == "plugin 'raises' raised in after_backward: ValueError: boom"
    assert caught.value.__notes__ == ["slipstream: plugin 'raises' raised in after_backward"]
    cell = check_combo(Combo(("raises",)), {"raises": Raises}, tmp_path / "compat", resume=False)
    assert (cell.outcome, cell.detail) == ("failed", "plugin 'raises' raised in after_backward: ValueError: boom")

    with pytest.raises(RuntimeError, match="the model broke"):
        train(tmp_path / "model", [Wraps()], model=BrokenModel(), max_duration="1ba")
    summary = json.loads((tmp_path / "model" / "run" / "summary.json").read_text())
    assert summary["error"] == "RuntimeError: the model broke"


class EpochsInMemory(Algorithm):
    """Scales the gradients by the epochs seen, counted in memory only."""

    name = "epochs_in_memory"

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self.epochs = 0

    @hookimpl
    def epoch_end(self, state):
        self.epochs += 1

    @hookimpl
    def before_optimizer_step(self, state):
        for p in state.unwrapped_model.parameters():
            if p.grad is not None:
                p.grad.mul_(1.0 + self.epochs)


class EpochsInCheckpoint(EpochsInMemory):
    name = "epochs_in_checkpoint"

    def state_dict(self):
        return {"epochs": self.epochs}

    def load_state_dict(self, state):
        self.epochs = state["epochs"]


def test_issue44_case10_the_resume_check_crosses_an_epoch_boundary(tmp_path):
    """issue 44, case 10: state a plugin carries across an epoch boundary in memory only
    is lost by a resume; the check resumed inside epoch 0 and called it "works". Kept in
    the plugin's state_dict, it resumes exactly."""
    classes = {c.name: c for c in (EpochsInMemory, EpochsInCheckpoint)}
    cell = check_combo(Combo(("epochs_in_memory",)), classes, tmp_path)
    assert cell.outcome == "failed" and f"resume from batch {RESUME_AT} (epoch 1) differs" in cell.detail, cell
    assert check_combo(Combo(("epochs_in_checkpoint",)), classes, tmp_path).outcome == "works"
