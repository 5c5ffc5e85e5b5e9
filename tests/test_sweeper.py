"""The sweep on a real Redis server and a migrated database: a dead worker's held work is sent again
a lease after its last heartbeat, and a live worker's never; unfinished work that the broker lost is
sent again, and only that; batches past their window are expired."""
from __future__ import annotations

import base64
import json
import shutil

import pytest
import redis

from app import create_app
from llmq.events import WORKERS_KEY, held_key, lease_key
from llmq.settings import Settings, queue_name
from llmq.store import batch_lifecycle
from llmq.store.models import Batch, File, Request
from workers.held_work import HeldWork
from workers.sweeper import Sweeper, SweepResult
from workers.tenant_intake import TenantIntake
from workers.work import Work

MODEL = "m"
LEASE = 30.0


@pytest.fixture()
def app(tmp_path, redis_url, migrated_db):
    shutil.copy(migrated_db, tmp_path / "llmq.db")
    url = f"sqlite:///{tmp_path / 'llmq.db'}"
    redis.Redis.from_url(redis_url).flushdb()
    settings = Settings(home=tmp_path, database_url=url, redis_url=redis_url, model_path=None, model_name=MODEL)
    return create_app(settings)


@pytest.fixture()
def sweeper(app) -> Sweeper:
    return Sweeper(app.extensions["llmq"].db, app.extensions["llmq"].redis, app.extensions["llmq"].celery, LEASE,
                   stream_ttl=60)


def queued_messages(app) -> list[tuple[str, list]]:
    """(task name, args) of every message waiting in the model's queue, all priority levels."""
    client = app.extensions["llmq"].redis
    found = []
    for key in client.keys(queue_name(MODEL) + "*"):
        for raw in client.lrange(key, 0, -1):
            message = json.loads(raw)
            found.append((message["headers"]["task"], json.loads(base64.b64decode(message["body"]))[0]))
    return sorted(found, key=str)


def make_batch(app, lines: int, expires_at: float = 1e12) -> tuple[str, list[int]]:
    content = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                    "body": {"prompt": "p", "max_tokens": 2}}) for i in range(lines)).encode()
    with app.extensions["llmq"].db.session() as session:
        file = File(filename="in.jsonl", purpose="batch", bytes=len(content), content=content)
        session.add(file)
        session.flush()
        batch = Batch(endpoint="/v1/completions", model=MODEL, input_file_id=file.id, expires_at=expires_at)
        session.add(batch)
        session.flush()
        return batch.id, batch_lifecycle.expand_input(session, batch, app.extensions["llmq"].model, app.extensions["llmq"].tokenizer, max_lines=100)


def test_lost_batch_lines_are_sent_again_after_a_lease(app, sweeper):
    _, (pending, running, leased) = make_batch(app, 3)
    db, client = app.extensions["llmq"].db, app.extensions["llmq"].redis
    with db.session() as session:
        batch_lifecycle.claim_item(session, running, "cmpl-dead-worker")
        batch_lifecycle.claim_item(session, leased, "cmpl-live-worker")
    client.set(lease_key("cmpl-live-worker"), "w1")

    assert sweeper.sweep(now=1000.0).resent == []  # first seen: the broker may still redeliver them
    assert sweeper.sweep(now=1000.0 + LEASE).resent == []
    result = sweeper.sweep(now=1001.0 + LEASE)
    assert sorted(result.resent) == [f"llmq.run_batch_item:{pending}", f"llmq.run_batch_item:{running}"]
    assert queued_messages(app) == sorted([("llmq.run_batch_item", [pending]), ("llmq.run_batch_item", [running])],
                                          key=str)
    assert client.llen(f"{queue_name(MODEL)}\x06\x166") == 2, "batch lines go at the batch priority"
    # Now the queue holds them: nothing more is sent while it does, however long.
    assert sweeper.sweep(now=5000.0).resent == []


def test_nothing_is_sent_while_the_queue_has_work(app, sweeper):
    _, (item,) = make_batch(app, 1)
    app.extensions["llmq"].celery.send_task("llmq.run_batch_item", args=[item], queue=queue_name(MODEL))
    assert sweeper.sweep(now=0.0).resent == []
    assert sweeper.sweep(now=10 * LEASE).resent == []
    assert len(queued_messages(app)) == 1


def test_a_lost_api_request_is_sent_again_and_a_finished_one_is_not(app, sweeper):
    with app.extensions["llmq"].db.session() as session:
        session.add(Request(id="cmpl-lost", model=MODEL, body={"prompt": "p"}, status="queued"))
        session.add(Request(id="cmpl-done", model=MODEL, body={"prompt": "p"}, status="completed"))
    sweeper.sweep(now=0.0)
    assert sweeper.sweep(now=LEASE + 1).resent == ["llmq.complete:cmpl-lost"]
    assert queued_messages(app) == [("llmq.complete", ["cmpl-lost"])]


def test_parked_work_is_waiting_for_its_turn_not_lost(app, sweeper):
    _, (parked, lost) = make_batch(app, 2)
    with app.extensions["llmq"].db.session() as session:
        session.add(Request(id="cmpl-parked", model=MODEL, body={"prompt": "p"}, status="queued"))
    intake = TenantIntake(app.extensions["llmq"].redis, MODEL, 4, 2, lambda t: 1.0, lambda work: None)
    intake.park("acme", Work("llmq.run_batch_item", parked, 6), Work("llmq.complete", "cmpl-parked"))
    sweeper.sweep(now=0.0)
    assert sweeper.sweep(now=LEASE + 1).resent == [f"llmq.run_batch_item:{lost}"]


def test_the_sweep_expires_batches_past_their_window(app, sweeper):
    batch_id, _ = make_batch(app, 2, expires_at=50.0)
    assert sweeper.sweep(now=49.0).expired_batches == []
    assert sweeper.sweep(now=50.0).expired_batches == [batch_id]
    with app.extensions["llmq"].db.session() as session:
        assert session.get(Batch, batch_id).status == "expired"
    assert sweeper.sweep(now=50.0 + 2 * LEASE).resent == [], "an expired batch's lines are not sent again"


def beat(client, name: str, instance: str, at: float) -> None:
    client.hset(WORKERS_KEY, name, json.dumps({"instance": instance, "model": MODEL, "state": "ready", "at": at}))


def test_a_dead_workers_held_work_is_sent_again_a_lease_after_its_last_heartbeat(app, sweeper):
    _, (dead_line, live_line) = make_batch(app, 2)
    client = app.extensions["llmq"].redis
    beat(client, "w0@h", "w0@h:aaaa", at=1000.0)
    beat(client, "w1@h", "w1@h:bbbb", at=1000.0)
    dead, live = HeldWork(client, "w0@h:aaaa", queue_name(MODEL)), HeldWork(client, "w1@h:bbbb", queue_name(MODEL))
    with dead.holding(Work("llmq.run_batch_item", dead_line, 6)), dead.holding(Work("llmq.complete", "cmpl-x")), \
            live.holding(Work("llmq.run_batch_item", live_line, 6)):
        assert sweeper.sweep(now=1000.0 + LEASE).taken_over == [], "a heartbeat a lease old: still alive"
        beat(client, "w1@h", "w1@h:bbbb", at=1000.0 + LEASE)  # w1 goes on beating; w0 has stopped
        result = sweeper.sweep(now=1001.0 + LEASE)
        assert sorted(result.taken_over) == sorted([f"llmq.run_batch_item:{dead_line}", "llmq.complete:cmpl-x"])
        assert queued_messages(app) == sorted([("llmq.run_batch_item", [dead_line]), ("llmq.complete", ["cmpl-x"])],
                                              key=str)
        assert client.llen(f"{queue_name(MODEL)}\x06\x166") == 1, "a held batch line goes back at its priority"
        assert not client.exists(held_key("w0@h:aaaa")), "sent once: the dead worker's record is gone"
        assert client.hkeys(WORKERS_KEY) == [b"w1@h"], "and so is its heartbeat"
        assert sweeper.sweep(now=1002.0 + LEASE).taken_over == []
        assert client.hlen(held_key("w1@h:bbbb")) == 1


def test_a_worker_restarted_under_the_same_name_is_not_the_run_that_died(app, sweeper):
    client = app.extensions["llmq"].redis
    old = HeldWork(client, "w0@h:old", queue_name(MODEL))
    with old.holding(Work("llmq.complete", "cmpl-y")):
        beat(client, "w0@h", "w0@h:new", at=2000.0)  # the restarted worker's heartbeat replaced the dead one's
        assert sweeper.sweep(now=2001.0).taken_over == ["llmq.complete:cmpl-y"]
    assert queued_messages(app) == [("llmq.complete", ["cmpl-y"])]


def test_work_a_live_worker_holds_is_no_orphan_however_long_it_runs(app, sweeper):
    _, (line,) = make_batch(app, 1)
    with app.extensions["llmq"].db.session() as session:
        session.add(Request(id="cmpl-long", model=MODEL, body={"prompt": "p"}, status="running"))
    client = app.extensions["llmq"].redis
    worker = HeldWork(client, "w1@h:cccc", queue_name(MODEL))
    with worker.holding(Work("llmq.run_batch_item", line, 6)), worker.holding(Work("llmq.complete", "cmpl-long")):
        for hour in range(3):
            now = 10_000.0 + 3600 * hour
            beat(client, "w1@h", "w1@h:cccc", at=now)
            assert sweeper.sweep(now=now).resent == []
            assert sweeper.sweep(now=now + LEASE / 2).taken_over == []
    assert queued_messages(app) == []


def test_the_lines_of_a_batch_being_expanded_are_not_orphans(app, sweeper):
    batch_id, _ = make_batch(app, 2)
    client = app.extensions["llmq"].redis
    beat(client, "w1@h", "w1@h:dddd", at=100.0)
    with HeldWork(client, "w1@h:dddd", queue_name(MODEL)).holding(Work("llmq.run_batch", batch_id)):
        sweeper.sweep(now=100.0)
        beat(client, "w1@h", "w1@h:dddd", at=100.0 + LEASE)
        assert sweeper.sweep(now=100.0 + LEASE + 1) == SweepResult()
    sweeper.sweep(now=200.0)  # the expansion ended without parking them (its worker died): now they are
    assert len(sweeper.sweep(now=200.0 + LEASE + 1).resent) == 2
