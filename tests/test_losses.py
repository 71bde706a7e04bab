"""The per-batch losses the metrics log and the divergence check read as one vector."""

import weakref
from types import SimpleNamespace

import pytest
import torch

from slipstream.services import losses as keeping
from slipstream.services.losses import TrainLosses, stack_losses


def test_scalar_losses_of_mixed_dtypes_become_one_float_vector():
    losses = [torch.tensor(1.5, dtype=torch.bfloat16), torch.tensor(2.0), torch.tensor(float("nan"))]
    vector = stack_losses(losses)
    assert vector.dtype == torch.float32 and vector.shape == (3,)
    assert vector[:2].tolist() == [1.5, 2.0] and vector[2].isnan()


def test_losses_of_shape_one_and_of_mixed_shapes_are_read_as_scalars():
    assert stack_losses([torch.tensor([1.0]), torch.tensor([2.0])]).tolist() == [1.0, 2.0]
    assert stack_losses([torch.tensor(1.0), torch.tensor([2.0])]).tolist() == [1.0, 2.0]


def test_a_loss_that_is_not_one_number_is_refused():
    with pytest.raises(RuntimeError):
        stack_losses([torch.ones(2), torch.ones(2)])


class Batches:
    """Just what TrainLosses reads of the state."""

    def __init__(self) -> None:
        self.timestamp = SimpleNamespace(batch=0)
        self.loss: torch.Tensor | None = None

    def step(self, keeper: TrainLosses, loss: float) -> None:
        self.loss = torch.tensor(loss, requires_grad=True) * 1  # a graph, as in training
        keeper.after_loss(self)
        self.timestamp.batch += 1


@pytest.mark.parametrize("fold", [256, 2])
def test_every_read_is_inspected_with_its_steps_and_the_mean_covers_all_reads(monkeypatch, fold):
    monkeypatch.setattr(keeping, "FOLD", fold)  # 2: stacked on the device every 2 batches
    seen: list[tuple[list[float], list[int]]] = []
    keeper = TrainLosses(inspector=lambda state, values, steps: seen.append((values, steps)))
    state = Batches()
    for value in (1.0, 2.0, 3.0):
        state.step(keeper, value)
    assert keeper.read(state) == [1.0, 2.0, 3.0]  # a checkpoint's read
    for value in (5.0, 7.0, 9.0, 11.0, 13.0):
        state.step(keeper, value)
    # The log's read: its mean holds the earlier read's values too.
    assert keeper.take_mean(state) == pytest.approx(51.0 / 8)
    assert seen == [([1.0, 2.0, 3.0], [1, 2, 3]), ([5.0, 7.0, 9.0, 11.0, 13.0], [4, 5, 6, 7, 8])]
    assert keeper.take_mean(state) is None and keeper.read(state) == []  # nothing new
    assert len(seen) == 2  # an empty read syncs nothing and shows nothing


def test_the_kept_losses_hold_no_graph():
    # A loss kept with its graph would keep the batch's activations alive until the next read.
    keeper, state = TrainLosses(), Batches()
    activation = torch.ones(1000, requires_grad=True) * 2  # saved for backward by the product below
    state.loss = (activation * activation).mean()
    keeper.after_loss(state)
    alive = weakref.ref(activation)
    del activation
    state.loss = None  # the step is over: only the keeper still holds the loss
    assert alive() is None
    state.timestamp.batch = 1
    assert keeper.read(state) == [4.0]


def test_host_values_reads_scalar_losses_and_falls_back_for_other_shapes():
    assert keeping.host_values([torch.tensor(1.5), torch.tensor(2.0)]) == [1.5, 2.0]
    assert keeping.host_values([torch.tensor(1.5, dtype=torch.bfloat16), torch.tensor(2.0)]) == [1.5, 2.0]
    assert keeping.host_values([torch.tensor([1.0]), torch.tensor([2.0])]) == [1.0, 2.0]  # (1,)-shaped
    assert keeping.host_values([torch.tensor(1.0), torch.tensor([2.0])]) == [1.0, 2.0]  # mixed shapes
    assert keeping.host_values([torch.tensor(3), torch.tensor(4)]) == [3.0, 4.0]  # integers become floats
    with pytest.raises(RuntimeError):
        keeping.host_values([torch.ones(2), torch.ones(2)])
