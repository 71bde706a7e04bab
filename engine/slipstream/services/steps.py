"""The default implementation of every step hook, registered ``trylast`` so that a
plugin's implementation replaces it and a plugin's wrapper surrounds it."""

from __future__ import annotations

from typing import Any

from ..hookspecs import hookimpl
from ..state import State


class DefaultSteps:
    name = "engine.steps"

    @hookimpl(trylast=True)
    def forward(self, state: State) -> Any:
        return state.model(state.batch[0])

    @hookimpl(trylast=True)
    def compute_loss(self, state: State) -> Any:
        return state.loss_fn(state.outputs, state.batch[1])

    @hookimpl(trylast=True)
    def backward(self, state: State) -> Any:
        state.loss.backward()
        return True

    @hookimpl(trylast=True)
    def should_step(self, state: State) -> Any:
        return True

    @hookimpl(trylast=True)
    def optimizer_step(self, state: State) -> Any:
        state.optimizer.step()
        return True
