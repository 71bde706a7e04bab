"""The per-batch losses the metrics log and the divergence check read as one vector."""

import pytest
import torch

from slipstream.services.losses import stack_losses


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
