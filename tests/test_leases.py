"""Leases on a real Redis server: one owner at a time, a lapsed lease is taken over, only the owner
renews or releases, and a process never runs one request twice."""
from __future__ import annotations

import threading
import time

import pytest
import redis

from llmq.events import lease_key
from workers.leases import Leases


@pytest.fixture(scope="module")
def client(redis_url):
    return redis.Redis.from_url(redis_url)


def test_one_owner_at_a_time_and_release_frees_it(client):
    a, b = Leases(client, "a", ttl_s=5), Leases(client, "b", ttl_s=5)
    assert a.acquire("r1")
    assert not b.acquire("r1")
    assert client.get(lease_key("r1")) == b"a"
    b.release("r1")  # not b's: nothing happens
    assert client.get(lease_key("r1")) == b"a"
    a.release("r1")
    assert client.get(lease_key("r1")) is None
    assert b.acquire("r1")
    b.release("r1")


def test_a_process_never_runs_a_request_twice(client):
    a = Leases(client, "a", ttl_s=5)
    assert a.acquire("r2")
    client.delete(lease_key("r2"))  # as if it lapsed while Redis was away
    assert not a.acquire("r2"), "a second delivery in the same process must wait for the first"
    a.release("r2")
    assert a.acquire("r2")
    a.release("r2")


def test_a_lapsed_lease_is_taken_over_and_its_old_owner_learns_it(client):
    a, b = Leases(client, "a", ttl_s=0.3), Leases(client, "b", ttl_s=5)
    assert a.acquire("r3")
    time.sleep(0.5)  # a stalled: no renewal
    assert b.acquire("r3")
    assert a.renew_all() == ["r3"]
    assert client.get(lease_key("r3")) == b"b", "the stalled owner must not take the lease back"
    assert b.renew_all() == []
    b.release("r3")
    a.release("r3")


def test_renewal_keeps_a_lease_alive_and_restores_a_lost_key(client):
    a = Leases(client, "a", ttl_s=0.4)
    assert a.acquire("r4")
    for _ in range(4):
        time.sleep(0.2)
        assert a.renew_all() == []
    assert client.get(lease_key("r4")) == b"a"
    client.delete(lease_key("r4"))  # Redis lost it (restarted without persistence)
    assert a.renew_all() == []
    assert client.get(lease_key("r4")) == b"a"
    assert 0 < client.pttl(lease_key("r4")) <= 400
    a.release("r4")


def test_a_request_leased_by_a_live_worker_is_skipped_and_a_dead_ones_is_taken_over(client):
    a, b = Leases(client, "a", ttl_s=0.3), Leases(client, "b", ttl_s=5)
    assert a.acquire("r5")
    started = time.monotonic()
    assert not b.acquire_unless_alive("r5", finished=lambda: False, alive={"a"}.__contains__, poll_s=0.05)
    assert time.monotonic() - started < 0.2, "a live holder's request is skipped at once"
    assert client.get(lease_key("r5")) == b"a"
    # "a" stopped sending heartbeats: its lease lapses within its ttl, and then "b" has the request.
    assert b.acquire_unless_alive("r5", finished=lambda: False, alive=set().__contains__, poll_s=0.05)
    assert time.monotonic() - started >= 0.25
    assert client.get(lease_key("r5")) == b"b"
    b.release("r5")


def test_taking_over_gives_up_when_the_request_finished_meanwhile(client):
    a, b = Leases(client, "a", ttl_s=5), Leases(client, "b", ttl_s=5)
    assert a.acquire("r6")
    done = threading.Event()
    threading.Timer(0.2, done.set).start()
    assert not b.acquire_unless_alive("r6", finished=done.is_set, alive=set().__contains__, poll_s=0.05)
    assert client.get(lease_key("r6")) == b"a"
    a.release("r6")


def test_a_second_delivery_in_the_process_that_runs_the_request_is_skipped(client):
    a = Leases(client, "a", ttl_s=5)
    assert a.acquire("r7")
    assert not a.acquire_unless_alive("r7", finished=lambda: False, alive=set().__contains__, poll_s=0.05)
    a.release("r7")
