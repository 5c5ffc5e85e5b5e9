"""The API tier's shared parts: web apps on one migrated database and one real Redis (the Redis
server and the migrated template database are tests/conftest.py's)."""
from __future__ import annotations

import shutil
import threading
import time

import pytest
import redis

from app.api import common
from llmq import fleet
from llmq.streams import publish_events

# ---- a stand-in for the worker: the web tier's tests run without one ------------------------------

class StandInWorker:
    """Replaces `enqueue`: records each request id and, if given `events`, publishes them a little
    later from another thread, as a worker would while the web process waits (llmq/events.py's
    contract). `hold` keeps the submission inside enqueue until it is set."""

    def __init__(self, r: redis.Redis):
        self.r, self.ids, self.events, self.hold = r, [], None, None

    def __call__(self, task_name, args, model):
        assert task_name == "llmq.complete"
        self.ids.append(args[0])
        if self.hold is not None:
            self.hold.wait(10)
        if self.events is not None:
            threading.Thread(target=self.publish, args=(args[0], self.events, 0.05), daemon=True).start()

    def publish(self, request_id, events, delay=0.0):
        for event in events:
            time.sleep(delay)
            publish_events(self.r, request_id, [event], maxlen=1000, ttl=60)


@pytest.fixture(autouse=True)
def a_worker_serves_every_model(monkeypatch):
    """The web tier's tests run with no worker, so no heartbeat says one serves their model: they
    would get 503 model_not_served. That check is tested against real heartbeats in
    tests/test_model_served.py."""
    monkeypatch.setattr(fleet, "is_served", lambda client, model, stale_after: True)


@pytest.fixture
def worker(monkeypatch, redis_url):
    stand_in = StandInWorker(redis.Redis.from_url(redis_url))
    monkeypatch.setattr(common, "enqueue", stand_in)
    return stand_in


# ---- access (keys, tenants, limits, idempotency): apps on one database and one Redis ----------------

ACCESS_MODEL = "stories260k"


@pytest.fixture
def make_app(tmp_path, migrated_db, redis_url, stories_dir):
    """A factory of web apps sharing one fresh migrated SQLite database and the (flushed) test Redis,
    as several web processes of one deployment do. Keyword arguments are Settings fields."""
    from app import create_app
    from llmq.settings import Settings

    db_path = tmp_path / "access.db"
    shutil.copy(migrated_db, db_path)
    redis.Redis.from_url(redis_url).flushdb()
    apps = []

    def make(**settings_fields):
        settings = Settings(**{"home": tmp_path, "database_url": f"sqlite:///{db_path}", "redis_url": redis_url,
                               "model_path": str(stories_dir), "model_name": ACCESS_MODEL, **settings_fields})
        flask_app = create_app(settings)
        flask_app.config["TESTING"] = True
        apps.append(flask_app)
        return flask_app

    yield make
    for flask_app in apps:
        flask_app.extensions["llmq"].celery.close()
        flask_app.extensions["llmq"].db.engine.dispose()


@pytest.fixture
def app(make_app):
    return make_app()


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture
def new_key():
    """new_key(app, tenant, **limits) -> (key id, request headers that carry the key)."""
    from llmq.store.api_keys import KeyLimits, create_key

    def make(flask_app, tenant: str, **limits) -> tuple[str, dict]:
        with flask_app.extensions["llmq"].db.session() as session:
            key, secret = create_key(session, tenant, limits=KeyLimits(**limits))
        return key.id, {"Authorization": f"Bearer {secret}"}

    return make
