"""How the products split their column runs between threads (llmq/model/csrc/work_split.h, StealingRuns):
each thread takes its own contiguous run front to back, then what is left of the others from their backs,
and every chunk goes to exactly one thread. Checked exactly, one call at a time, through the kernels'
test entry point; the products' results with two threads are checked in test_cpu_prepack.py."""
from __future__ import annotations

import random

import pytest

from llmq.model.cpu_kernels import native_kernels, native_kernels_failure


@pytest.fixture(scope="module")
def order():
    built = native_kernels()
    assert built is not None, f"the CPU kernels did not build here: {native_kernels_failure()}"
    return built._ops.stealing_runs_order


def test_a_thread_takes_its_own_run_in_order_then_the_others_from_the_back(order):
    assert order(10, 2, [0] * 11) == [0, 1, 2, 3, 4, 9, 8, 7, 6, 5, -1]


def test_threads_at_one_pace_each_keep_to_their_own_run(order):
    assert order(6, 2, [0, 1] * 4) == [0, 3, 1, 4, 2, 5, -1, -1]


def test_a_faster_thread_takes_the_slower_ones_last_chunks(order):
    # Thread 0 asks three times as often: after its own run it takes run 1's back while thread 1 still
    # works through run 1's front.
    assert order(8, 2, [0, 0, 0, 1] * 3) == [0, 1, 2, 4, 3, 7, 6, 5, -1, -1, -1, -1]


def test_a_thread_done_early_takes_from_the_run_with_the_most_left(order):
    # Runs [0, 3), [3, 6), [6, 10). Thread 0, done first, takes run 2's last (4 left against 3); thread 1
    # takes its 3; run 2 still has the most left (3 against 2), then runs 1 and 2 are level at 2, and the
    # first of them is taken from.
    assert order(10, 3, [0, 0, 0, 0, 1, 0, 0, 0]) == [0, 1, 2, 9, 3, 8, 5, 7]


def test_fewer_chunks_than_threads(order):
    assert order(1, 2, [1, 0]) == [0, -1]
    assert order(1, 2, [0, 1]) == [0, -1]
    assert order(0, 2, [0, 1]) == [-1, -1]


@pytest.mark.parametrize("seed", range(5))
def test_every_chunk_goes_to_exactly_one_thread_whatever_the_pace(order, seed):
    rng = random.Random(seed)
    chunks, parts = rng.randint(1, 200), rng.randint(1, 8)
    callers = [rng.randrange(parts) for _ in range(3 * chunks + parts)]
    taken = order(chunks, parts, callers)
    handed = [chunk for chunk in taken if chunk >= 0]
    assert sorted(handed) == list(range(chunks))
    assert taken[len(handed):] == [-1] * (len(taken) - len(handed))  # none handed out after the first "none left"


def test_a_bad_call_is_refused_with_a_reason(order):
    with pytest.raises(RuntimeError, match="no run 2 of 2"):
        order(4, 2, [2])
