"""The API tier's shared parts: web apps on one migrated database and one real Redis (the Redis
server and the migrated template database are tests/conftest.py's)."""
from __future__ import annotations

import shutil

import pytest

# ---- access (keys, tenants, limits, idempotency): apps on one database and one Redis ----------------

ACCESS_MODEL = "stories260k"


@pytest.fixture
def make_app(tmp_path, migrated_db, redis_url, stories_dir):
    """A factory of web apps sharing one fresh migrated SQLite database and the (flushed) test Redis,
    as several web processes of one deployment do. Keyword arguments are Settings fields."""
    import redis

    from app import create_app
    from app.config import Settings

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
        flask_app.extensions["celery"].close()
        flask_app.extensions["llmq_db"].engine.dispose()


@pytest.fixture
def app(make_app):
    return make_app()


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture
def new_key():
    """new_key(app, tenant, **limits) -> (key id, request headers that carry the key)."""
    from app.api_keys import KeyLimits, create_key

    def make(flask_app, tenant: str, **limits) -> tuple[str, dict]:
        with flask_app.extensions["llmq_db"].session() as session:
            key, secret = create_key(session, tenant, limits=KeyLimits(**limits))
        return key.id, {"Authorization": f"Bearer {secret}"}

    return make
