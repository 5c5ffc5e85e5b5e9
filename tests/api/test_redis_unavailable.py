"""With Redis away (down, or still loading its data), every endpoint that needs it answers 503 with
Retry-After in the OpenAI error shape, never a 500, and nothing else is lost."""
from __future__ import annotations

import shutil
import time

import pytest

from app import create_app
from llmq.settings import Settings
from llmq.store.models import Request
from stack.local import free_port
from tests.conftest import STORIES_DIR

MODEL = "stories"


@pytest.fixture
def app(tmp_path, migrated_db):
    shutil.copy(migrated_db, tmp_path / "llmq.db")
    flask_app = create_app(Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'llmq.db'}",
                                    redis_url=f"redis://127.0.0.1:{free_port()}/0",  # nothing listens there
                                    model_path=str(STORIES_DIR), model_name=MODEL, redis_retry_seconds=1))
    yield flask_app
    flask_app.extensions["llmq"].db.engine.dispose()


def assert_unavailable(response):
    assert response.status_code == 503, response.get_data(as_text=True)
    assert int(response.headers["Retry-After"]) > 0
    error = response.get_json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "service_unavailable") and "Redis" in error["message"]


def test_reading_a_request_while_redis_is_away_is_a_503(app):
    with app.extensions["llmq"].db.session() as session:
        session.add(Request(id="cmpl-away", kind="completion", model=MODEL, body={}, status="running",
                            created_at=time.time()))
    client = app.test_client()
    assert_unavailable(client.get("/v1/requests/cmpl-away"))  # the text so far is in its stream
    assert_unavailable(client.get("/v1/requests/cmpl-away/events"))


def test_a_completion_that_cannot_be_queued_is_a_503_and_its_row_says_so(app):
    client = app.test_client()
    assert_unavailable(client.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 2}))
    with app.extensions["llmq"].db.read() as session:
        [row] = session.query(Request).all()
        assert row.status == "failed" and row.error["code"] == "server_error"
