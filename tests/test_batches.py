"""Moving batches to the device: the loop's cheap path for CPU batches and the
general one it falls back to."""

import torch

from slipstream.services.batches import batch_mover, to_device


def test_a_cpu_batch_of_tensors_is_passed_as_a_tuple_of_the_same_tensors():
    x, y = torch.ones(2, 3), torch.zeros(2, dtype=torch.long)
    move = batch_mover(torch.device("cpu"))
    for batch in ([x, y], (x, y)):
        moved = move(batch)
        assert type(moved) is tuple and moved[0] is x and moved[1] is y


def test_other_batches_take_the_general_path():
    move = batch_mover(torch.device("cpu"))
    x = torch.ones(2)
    assert move({"x": x})["x"] is x
    nested = move([x, [x, "label"]])
    assert nested[1] == (x, "label") and type(nested[1]) is tuple  # lists become tuples at every depth
    parameter = torch.nn.Parameter(torch.ones(1))  # a subclass: not the fast path, same result
    assert move([parameter])[0] is parameter


def test_a_mover_for_another_device_moves_every_tensor():
    meta = torch.device("meta")  # stands in for an accelerator: CPU tensors must move
    moved = batch_mover(meta)([torch.ones(2), torch.zeros(2)])
    assert all(t.device == meta for t in moved)
    assert to_device([torch.ones(1)], meta)[0].device == meta


def test_a_cpu_batch_of_other_lengths_is_tested_item_by_item():
    move = batch_mover(torch.device("cpu"))
    x, y, w = torch.ones(2, 3), torch.zeros(2, dtype=torch.long), torch.ones(2)
    moved = move([x, y, w])
    assert type(moved) is tuple and all(a is b for a, b in zip(moved, (x, y, w), strict=True))
    assert move([x, "label"]) == (x, "label")  # a pair that is not two tensors: the general path
