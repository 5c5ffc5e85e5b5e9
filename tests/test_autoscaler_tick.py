"""One tick of the autoscaler process (stack/autoscaler.py) against a real Redis: which workers it
counts, which it stops, what it publishes, what start-up it measures. The heartbeats and queued
messages are written into Redis as workers and the web write them; the backend starts small Python
programs in place of Celery workers (tests/service/test_autoscaler.py runs real ones)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time

import pytest

from llmq import fleet
from llmq.autoscale.config import AutoscaleConfig, PolicyConfig
from llmq.events import WORKERS_KEY
from llmq.store.database import Database
from stack.autoscaler import Autoscaler
from stack.worker_backends import LocalBackend

SLEEPER = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); time.sleep(60)"
CONFIG = AutoscaleConfig(PolicyConfig(min_workers=1, max_workers=3, target_ongoing=4, upscale_delay_s=0,
                                      downscale_delay_s=0), tick_s=1, startup_s=10)


@pytest.fixture()
def autoscaler(tmp_path, migrated_db, redis_db):
    shutil.copy(migrated_db, tmp_path / "llmq.db")
    backend = LocalBackend(lambda model: {"PATH": "/usr/bin:/bin"}, tmp_path,
                           command=lambda name: [sys.executable, "-c", SLEEPER])
    scaler = Autoscaler(CONFIG, backend, ["m"], redis_db, Database(f"sqlite:///{tmp_path / 'llmq.db'}"),
                        stale_after=30)
    yield scaler
    scaler.close(timeout=10)


def beat(client, name: str, model: str = "m", **fields) -> None:
    client.hset(WORKERS_KEY, f"{name}@host", json.dumps({"model": model, "at": time.time(), "running": 0,
                                                        "waiting": 0, **fields}))


def queue(client, count: int) -> None:
    client.delete(fleet.broker_list("m", 0))
    if count:
        client.rpush(fleet.broker_list("m", 0), *[b"task"] * count)


def own(autoscaler) -> dict[str, bool]:
    """Its workers, by name: whether each was told to stop."""
    return {w.name: w.stopping_since is not None for w in autoscaler.backend.workers("m")}


def test_it_starts_the_minimum_and_counts_a_starting_worker(autoscaler, redis_db):
    autoscaler.tick()
    (first,) = own(autoscaler)
    autoscaler.tick()  # still starting (no heartbeat yet): counted, so nothing more is started
    assert list(own(autoscaler)) == [first]
    status = fleet.autoscalers(redis_db, 30)["m"]
    assert {k: status[k] for k in ("desired", "actual", "min", "max", "backend", "queued", "in_flight")} == \
        {"desired": 1, "actual": 1, "min": 1, "max": 3, "backend": "local", "queued": 0, "in_flight": 0}


def test_it_scales_up_for_the_queue_and_stops_the_idlest_of_its_own(autoscaler, redis_db):
    autoscaler.tick()
    (first,) = own(autoscaler)
    beat(redis_db, first, running=2)
    beat(redis_db, "someone-elses", running=3)  # counted, never stopped
    beat(redis_db, "leaving", state="draining", running=1)  # not counted
    beat(redis_db, "other-model", model="n", running=4)  # not this model's
    queue(redis_db, 10)
    autoscaler.tick()  # 10 queued + 6 on workers = 16: 4 wanted, 3 at most; 2 counted, so 1 started
    assert len(own(autoscaler)) == 2
    assert fleet.autoscalers(redis_db, 30)["m"]["actual"] == 2
    second = next(name for name in own(autoscaler) if name != first)

    queue(redis_db, 0)  # 6 on workers: 2 wanted; the idlest of its own is the one still starting
    autoscaler.tick()
    assert own(autoscaler) == {first: False, second: True}

    beat(redis_db, first, running=0)
    beat(redis_db, "someone-elses", running=0)
    beat(redis_db, "leaving", state="draining", running=0)
    autoscaler.tick()  # 0 on workers: 1 wanted of the 2 counted; its own is stopped, the other one's kept
    assert own(autoscaler).get(first) is True
    assert fleet.autoscalers(redis_db, 30)["m"]["desired"] == 1


def test_a_worker_it_started_is_measured_when_ready(autoscaler, redis_db):
    autoscaler.tick()
    (worker,) = autoscaler.backend.workers("m")
    beat(redis_db, worker.name, state="starting")
    autoscaler.tick()
    assert autoscaler.startup_measured == []
    beat(redis_db, worker.name, state="ready", ready_at=worker.started_at + 4.5)
    autoscaler.tick()
    autoscaler.tick()
    assert autoscaler.startup_measured == [4.5] and autoscaler.startup_s == 4.5
    assert fleet.autoscalers(redis_db, 30)["m"]["startup_s"] == 4.5


def test_a_crashed_worker_is_no_longer_counted_and_is_replaced(autoscaler, redis_db):
    autoscaler.tick()
    (worker,) = autoscaler.backend.workers("m")
    os.kill(worker.pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while autoscaler.backend.workers("m") == [worker] and time.monotonic() < deadline:
        autoscaler.tick()  # reaps it, and the floor starts another at once
        time.sleep(0.1)
    (replacement,) = autoscaler.backend.workers("m")
    assert replacement.name != worker.name and worker.exit_code == -signal.SIGKILL


def test_closing_stops_its_workers_and_withdraws_its_decision(autoscaler, redis_db):
    autoscaler.tick()
    assert "m" in fleet.autoscalers(redis_db, 30)
    autoscaler.close(timeout=10)
    assert autoscaler.backend.workers() == [] and fleet.autoscalers(redis_db, 30) == {}


def test_without_the_database_it_still_scales_from_redis(tmp_path, redis_db, caplog):
    backend = LocalBackend(lambda model: {"PATH": "/usr/bin:/bin"}, tmp_path,
                           command=lambda name: [sys.executable, "-c", SLEEPER])
    scaler = Autoscaler(CONFIG, backend, ["m"], redis_db, Database(f"sqlite:///{tmp_path / 'missing' / 'llmq.db'}"),
                        stale_after=30)
    try:
        queue(redis_db, 12)
        scaler.tick()
        assert len(backend.workers("m")) == 3
        assert "could not count the arrivals" in caplog.text
    finally:
        scaler.close(timeout=10)
