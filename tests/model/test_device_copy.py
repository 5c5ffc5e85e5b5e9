"""to_device builds the same tensor torch.tensor would, through numpy for integer lists."""
from __future__ import annotations

import pytest
import torch

from llmq.model.device_copy import to_device

CASES = [
    ([3, 1, 4, 1, 5], torch.long),
    ([[7, 0, 2], [9, 8, 0]], torch.int32),  # block tables
    ([(4, 0), (9, 1)], torch.long),  # (row, index) pairs
    ([], torch.long),
    ([[]], torch.int32),
    ([0.1, 0.7, 1.3], torch.float32),
    ([0.1, 0.7, 1.3], torch.float64),
    ([0.1, 0.7, 1.3], torch.bfloat16),
    ([1e39, 0.5], torch.float32),  # past float32: inf, as torch.tensor gives it
    ([True, False, True], torch.bool),
    ([2 ** 40, -5], torch.long),
]


@pytest.mark.parametrize("values,dtype", CASES)
def test_to_device_is_torch_tensor_on_the_device(values, dtype):
    got = to_device(values, torch.device("cpu"), dtype)
    want = torch.tensor(values, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_ragged_rows_are_refused():
    with pytest.raises(ValueError):
        to_device([[1, 2], [3]], torch.device("cpu"), torch.int32)
