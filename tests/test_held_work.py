"""A worker's held work on a real Redis server: an entry from a task's start to its end, one entry for
two deliveries of a task in one process, and what the sweep reads back."""
from __future__ import annotations

import pytest
import redis

from llmq.events import held_key
from workers.held_work import HeldEntry, HeldWork, held_keys, holders, read_held
from workers.work import Work


@pytest.fixture()
def client(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    return r


def test_an_entry_lasts_as_long_as_the_task(client):
    held = HeldWork(client, "w0@h:1", "llmq.m")
    line, request = Work("llmq.run_batch_item", 7, 6), Work("llmq.complete", "cmpl-a")
    with held.holding(line):
        with held.holding(request):
            assert held.held() == 2
            assert sorted(read_held(client, "w0@h:1"), key=str) == sorted(
                [HeldEntry(line, "llmq.m"), HeldEntry(request, "llmq.m")], key=str)
            assert held_keys(client) == {"llmq.run_batch_item:7", "llmq.complete:cmpl-a"}
        assert read_held(client, "w0@h:1") == [HeldEntry(line, "llmq.m")]
    assert held.held() == 0 and not client.exists(held_key("w0@h:1"))
    assert holders(client) == []


def test_two_deliveries_in_one_process_share_one_entry_until_the_last_ends(client):
    held = HeldWork(client, "w0@h:1", "llmq.m")
    work = Work("llmq.complete", "cmpl-b")
    with held.holding(work):
        with held.holding(work):
            assert held.held() == 1
        assert read_held(client, "w0@h:1") == [HeldEntry(work, "llmq.m")], "the first delivery still runs"
    assert read_held(client, "w0@h:1") == []


def test_holders_are_every_instance_with_a_record(client):
    with HeldWork(client, "w0@h:1", "q").holding(Work("t", 1)), HeldWork(client, "w1@h:2", "q").holding(Work("t", 2)):
        assert holders(client) == ["w0@h:1", "w1@h:2"]
