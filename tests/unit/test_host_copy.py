"""Host numbers onto the model's device (`workers.host_copy`): on a CPU, the plain tensor."""

from __future__ import annotations

import torch

from workers.host_copy import to_device


def test_host_values_arrive_with_their_dtype_on_the_device():
    ids = to_device([3, 1, 4], torch.device("cpu"))
    assert ids.dtype == torch.long and ids.device.type == "cpu"
    assert ids.tolist() == [3, 1, 4]
    temps = to_device([0.5, 2.0], "cpu", torch.float32)
    assert temps.dtype == torch.float32 and temps.tolist() == [0.5, 2.0]


def test_an_empty_list_is_an_empty_tensor():
    assert to_device([], "cpu").shape == (0,)
