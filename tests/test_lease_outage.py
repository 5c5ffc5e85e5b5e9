"""A task whose lease cannot be taken because Redis is away has not started: once Redis answers it goes
back to the queue, as a task whose checkpoint could not be read does (workers/tasks.py, _take_lease).
A real redis-server, stopped and started again on the same port."""
from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import pytest
import redis
from celery.exceptions import Reject

from llmq.embedded_redis import start_redis_server, wait_for_redis
from llmq.events import lease_key
from stack.local import free_port
from workers.leases import Leases
from workers.tasks import _take_lease


@pytest.fixture
def server(tmp_path):
    """A redis-server of the test's own: start() and stop() it at will."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    state = SimpleNamespace(url=url, process=None)

    def start():
        state.process = start_redis_server(tmp_path / "redis", port, daemonize=False)
        wait_for_redis(url)

    def stop():
        state.process.terminate()
        state.process.wait(timeout=10)

    state.start, state.stop = start, stop
    start()
    yield state
    if state.process.poll() is None:
        stop()


def runtime_on(url: str, outage_s: float):
    """The parts of a worker's runtime that taking a lease touches, on the real Redis at `url`."""
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
    return SimpleNamespace(redis=client, leases=Leases(client, "w-test", ttl_s=5),
                           is_alive=lambda name: False, settings=SimpleNamespace(redis_outage_seconds=outage_s))


def test_lease_is_taken_while_redis_answers(server):
    runtime = runtime_on(server.url, outage_s=5)
    assert _take_lease(runtime, "cmpl-up", finished=lambda: False)
    assert runtime.redis.get(lease_key("cmpl-up")) == b"w-test"


def test_redis_away_at_the_lease_requeues_the_task_once_it_is_back(server, caplog):
    runtime = runtime_on(server.url, outage_s=30)
    server.stop()
    back = threading.Timer(1.5, server.start)
    back.start()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="workers.tasks"), pytest.raises(Reject) as rejected:
        _take_lease(runtime, "cmpl-away", finished=lambda: False)
    back.join()
    assert rejected.value.requeue, "the task must go back to the queue, not be dropped"
    assert time.monotonic() - started >= 1.0, "it must wait for Redis, not give up at once"
    assert "could not start: Redis was away" in caplog.text and "Redis is back" in caplog.text
    assert runtime.redis.get(lease_key("cmpl-away")) is None, "a requeued task holds no lease"


def test_redis_away_past_the_outage_window_raises(server):
    runtime = runtime_on(server.url, outage_s=1.5)
    server.stop()
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        _take_lease(runtime, "cmpl-gone", finished=lambda: False)
    assert time.monotonic() - started >= 1.0, "it waits out the outage window before giving up"
