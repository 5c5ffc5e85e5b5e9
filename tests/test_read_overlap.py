"""benchmarks/read_overlap.py: its shares, exactly, and that its loop (built here, as the benchmark builds it)
does the arithmetic it is timed for: each row's sums over every 64 bytes' widened bfloat16 pairs."""
import pytest
import torch

from benchmarks.read_overlap import build, floor_share, hidden_share, row_flops


def test_floor_share_is_the_longer_alone_over_both_together():
    assert floor_share(2.0, 3.0, 4.0) == 0.75
    assert floor_share(3.0, 2.0, 3.0) == 1.0  # a full overlap
    assert floor_share(1.0, 1.0, 2.0) == 0.5  # none: the two one after the other


def test_hidden_share_is_how_much_of_the_shorter_ran_under_the_longer():
    assert hidden_share(2.0, 3.0, 3.0) == 1.0
    assert hidden_share(2.0, 3.0, 5.0) == 0.0
    assert hidden_share(3.0, 2.0, 4.0) == 0.5


def test_row_flops_count_32_weights_a_line_into_every_row():
    assert row_flops(1, 64) == 64
    assert row_flops(16, 1 << 20) == 2 * 16 * (1 << 14) * 32


@pytest.fixture(scope="module")
def loop():
    return build()


def reference_sums(data: torch.Tensor, x: torch.Tensor, threads: int, passes: int) -> torch.Tensor:
    """[threads, rows, 16]: each thread's run of lines, each lane's pair (low half: the even input's weight)."""
    pairs = data.view(torch.int16).view(threads, -1, 16, 2)  # [thread, line, lane, (even, odd)]
    weights = pairs.view(torch.bfloat16).double()
    even, odd = weights[..., 0].sum(1), weights[..., 1].sum(1)  # [thread, lane]
    x = x.double()
    return passes * (x[None, :, 0, None] * even[:, None, :] + x[None, :, 1, None] * odd[:, None, :])


@pytest.mark.parametrize("rows", [1, 4, 12, 32])
def test_the_loop_sums_each_rows_products(loop, rows):
    threads, lines = 2, 48
    data = torch.randn(threads * lines * 32).to(torch.bfloat16).view(torch.uint8)
    x = torch.randn(rows, 2)
    got = loop.stream_rows(data, x, 3, 64, threads)
    assert got.shape == (threads, rows, 16)
    torch.testing.assert_close(got.double(), reference_sums(data, x, threads, 3), rtol=1e-4, atol=1e-4)


def test_the_loop_refuses_a_row_count_it_has_no_loop_for(loop):
    with pytest.raises(RuntimeError, match="rows must be one of"):
        loop.stream_rows(torch.zeros(128, dtype=torch.uint8), torch.zeros(3, 2), 1, 0, 1)
