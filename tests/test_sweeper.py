"""The sweep on a real Redis server and a migrated database: unfinished work that the broker lost is
sent again after the visibility timeout, and only that; batches past their window are expired."""
from __future__ import annotations

import base64
import json
import shutil

import pytest
import redis

from app import create_app
from llmq.events import lease_key
from llmq.settings import Settings, queue_name
from llmq.store import batch_lifecycle
from llmq.store.models import Batch, File, Request
from workers.sweeper import Sweeper
from workers.tenant_intake import ParkedWork, TenantIntake

MODEL = "m"
VISIBILITY = 100.0


@pytest.fixture()
def app(tmp_path, redis_url, migrated_db):
    shutil.copy(migrated_db, tmp_path / "llmq.db")
    url = f"sqlite:///{tmp_path / 'llmq.db'}"
    redis.Redis.from_url(redis_url).flushdb()
    settings = Settings(home=tmp_path, database_url=url, redis_url=redis_url, model_path=None, model_name=MODEL)
    return create_app(settings)


@pytest.fixture()
def sweeper(app) -> Sweeper:
    return Sweeper(app.extensions["llmq"].db, app.extensions["llmq"].redis, app.extensions["llmq"].celery, VISIBILITY,
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


def test_lost_batch_lines_are_sent_again_after_the_visibility_timeout(app, sweeper):
    _, (pending, running, leased) = make_batch(app, 3)
    db, client = app.extensions["llmq"].db, app.extensions["llmq"].redis
    with db.session() as session:
        batch_lifecycle.claim_item(session, running, "cmpl-dead-worker")
        batch_lifecycle.claim_item(session, leased, "cmpl-live-worker")
    client.set(lease_key("cmpl-live-worker"), "w1")

    assert sweeper.sweep(now=1000.0).resent == []  # first seen: the broker may still redeliver them
    assert sweeper.sweep(now=1000.0 + VISIBILITY).resent == []
    result = sweeper.sweep(now=1001.0 + VISIBILITY)
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
    assert sweeper.sweep(now=10 * VISIBILITY).resent == []
    assert len(queued_messages(app)) == 1


def test_a_lost_api_request_is_sent_again_and_a_finished_one_is_not(app, sweeper):
    with app.extensions["llmq"].db.session() as session:
        session.add(Request(id="cmpl-lost", model=MODEL, body={"prompt": "p"}, status="queued"))
        session.add(Request(id="cmpl-done", model=MODEL, body={"prompt": "p"}, status="completed"))
    sweeper.sweep(now=0.0)
    assert sweeper.sweep(now=VISIBILITY + 1).resent == ["llmq.complete:cmpl-lost"]
    assert queued_messages(app) == [("llmq.complete", ["cmpl-lost"])]


def test_parked_work_is_waiting_for_its_turn_not_lost(app, sweeper):
    _, (parked, lost) = make_batch(app, 2)
    with app.extensions["llmq"].db.session() as session:
        session.add(Request(id="cmpl-parked", model=MODEL, body={"prompt": "p"}, status="queued"))
    intake = TenantIntake(app.extensions["llmq"].redis, MODEL, 4, 2, lambda t: 1.0, lambda work: None)
    intake.park("acme", ParkedWork("llmq.run_batch_item", parked, 6), ParkedWork("llmq.complete", "cmpl-parked"))
    sweeper.sweep(now=0.0)
    assert sweeper.sweep(now=VISIBILITY + 1).resent == [f"llmq.run_batch_item:{lost}"]


def test_the_sweep_expires_batches_past_their_window(app, sweeper):
    batch_id, _ = make_batch(app, 2, expires_at=50.0)
    assert sweeper.sweep(now=49.0).expired_batches == []
    assert sweeper.sweep(now=50.0).expired_batches == [batch_id]
    with app.extensions["llmq"].db.session() as session:
        assert session.get(Batch, batch_id).status == "expired"
    assert sweeper.sweep(now=50.0 + 2 * VISIBILITY).resent == [], "an expired batch's lines are not sent again"
