"""`Plugin`, what an algorithm and a callback share: a name, a config and state."""

from __future__ import annotations

from typing import Any, ClassVar


class Plugin:
    """A name (what users type to enable it), an optional ``config_class``
    dataclass (whose ``__post_init__`` raises ``ValueError`` for an out-of-range
    value) and hook methods decorated with :data:`slipstream.hookimpl`. The engine
    builds a plugin as ``cls(config)``. State that must survive a checkpoint goes
    through ``state_dict`` / ``load_state_dict``.

    ``kind`` says which it is (``"algorithm"`` or ``"callback"``): the config
    section (``algorithms.<name>``, ``callbacks.<name>``) and messages use it.

    ``weights`` names model weights the plugin keeps in its checkpoint state besides
    the model's own (``"ema"``), under ``state_dict()["weights"]`` with the model's
    parameter names: evaluation, export and fine-tuning may select them
    (``--weights``/``--ema``, ``trainer.load_weights``).

    ``export_model(model)`` says what becomes of the plugin's model surgery in a model
    exported for inference: the default keeps it (the model as trained, e.g.
    channels-last weights or added layers whose weights were learnt); a plugin whose
    surgery only serves training (activation checkpointing, compilation) undoes it.

    ``run_files`` names what the plugin writes directly under the run directory
    (files or folders, e.g. ``("tensorboard",)``): they are the run's files, so
    ``trainer.overwrite=true`` removes them with the engine's own.
    """

    kind: ClassVar[str] = "plugin"
    run_files: ClassVar[tuple[str, ...]] = ()
    name: ClassVar[str] = ""
    config_class: ClassVar[type | None] = None
    weights: ClassVar[str | None] = None

    def __init__(self, config: Any = None) -> None:
        if config is None and self.config_class is not None:
            config = self.config_class()
        self.config = config

    @classmethod
    def summary(cls) -> str:
        """One line for ``slipstream algorithms`` / ``callbacks``: the docstring's first line."""
        doc = (cls.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    def export_model(self, model: Any) -> Any:
        """The model to export after this plugin's ``init`` surgery: ``model`` as is
        (the surgery stays), or with the surgery undone. Called in reverse run order."""
        return model

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"
