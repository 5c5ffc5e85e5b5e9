"""The admission limit that keeps a worker from taking more than its engine can run soon, exactly."""
from __future__ import annotations

import pytest

from workers.capacity import admission_limit, capacity, headroom, is_saturated


def stats(running=0, waiting=0, free_blocks=1000, total_blocks=1000) -> dict:
    return {"running": running, "waiting": waiting, "free_blocks": free_blocks, "total_blocks": total_blocks}


@pytest.mark.parametrize("max_num_seqs, spare", [(1, 1), (4, 1), (8, 1), (16, 2), (128, 16), (256, 32)])
def test_headroom_is_an_eighth_of_max_num_seqs_and_at_least_one(max_num_seqs, spare):
    assert headroom(max_num_seqs) == spare


def test_an_idle_engine_takes_max_num_seqs_and_its_headroom():
    assert admission_limit(stats(), max_num_seqs=16, held=0) == 18
    assert capacity(stats(), max_num_seqs=16, held=0) == 18
    assert capacity(stats(running=10), max_num_seqs=16, held=10) == 8
    assert capacity(stats(running=16, waiting=2), max_num_seqs=16, held=18) == 0


def test_an_engine_whose_own_queue_is_longer_than_the_headroom_is_saturated_and_takes_one_at_a_time():
    assert is_saturated(stats(running=6, waiting=3), max_num_seqs=16)
    assert admission_limit(stats(running=6, waiting=3), max_num_seqs=16, held=9) == 10
    assert capacity(stats(running=6, waiting=3), max_num_seqs=16, held=9) == 0
    assert not is_saturated(stats(running=6, waiting=2), max_num_seqs=16)
    assert admission_limit(stats(running=6, waiting=2), max_num_seqs=16, held=8) == 18


def test_a_nearly_full_kv_cache_is_saturated():
    assert is_saturated(stats(running=3, free_blocks=19, total_blocks=1000), max_num_seqs=16)
    assert admission_limit(stats(running=3, free_blocks=19, total_blocks=1000), max_num_seqs=16, held=3) == 4
    assert admission_limit(stats(running=3, free_blocks=20, total_blocks=1000), max_num_seqs=16, held=3) == 18


def test_the_limit_never_drops_below_what_the_worker_holds_nor_to_zero():
    # A request of many choices fills the engine alone; the worker keeps what it took, and one more.
    assert admission_limit(stats(running=16, waiting=40), max_num_seqs=16, held=1) == 2
    assert admission_limit(stats(waiting=40), max_num_seqs=16, held=0) == 1, "0 would mean no limit to the broker"
    assert admission_limit(stats(), max_num_seqs=4, held=30) == 30
    assert admission_limit({}, max_num_seqs=4, held=0) == 5, "an engine that reports nothing yet"
