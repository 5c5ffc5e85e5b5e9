"""A task that Redis being away stops before its run starts (its cancel flag, its lease or its checkpoint
unread) goes back to the queue once Redis answers (workers/tasks.py, _before_start). A real redis-server,
stopped and started again on the same port."""
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
from llmq.streams import is_cancelled
from stack.local import free_port
from workers.leases import Leases
from workers.tasks import _before_start, _take_lease


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
    """The parts of a worker's runtime that a task's first asks of Redis touch, on the real Redis at `url`."""
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
    return SimpleNamespace(redis=client, leases=Leases(client, "w-test", ttl_s=5),
                           is_alive=lambda name: False, settings=SimpleNamespace(redis_outage_seconds=outage_s))


def test_lease_is_taken_while_redis_answers(server):
    runtime = runtime_on(server.url, outage_s=5)
    assert _take_lease(runtime, "cmpl-up", finished=lambda: False)
    assert runtime.redis.get(lease_key("cmpl-up")) == b"w-test"


FIRST_TOUCHES = {  # what a task asks of Redis before its run starts
    "lease": lambda runtime, request_id: _take_lease(runtime, request_id, finished=lambda: False),
    "cancel flag": lambda runtime, request_id: _before_start(runtime, request_id,
                                                             lambda: is_cancelled(runtime.redis, request_id)),
}


@pytest.mark.parametrize("touch", FIRST_TOUCHES)
def test_redis_away_before_the_run_requeues_the_task_once_it_is_back(server, caplog, touch):
    runtime = runtime_on(server.url, outage_s=30)
    server.stop()
    back = threading.Timer(1.5, server.start)
    back.start()
    started = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="workers.tasks"), pytest.raises(Reject) as rejected:
            FIRST_TOUCHES[touch](runtime, "cmpl-away")
    finally:
        back.join()  # the server is up again before the fixture's teardown looks, pass or fail
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
