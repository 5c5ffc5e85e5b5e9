"""A request for a model that no worker serves and no autoscaler can start is refused at once (503
model_not_served, in the OpenAI shape), with real heartbeats and autoscaler records in a real Redis."""
from __future__ import annotations

import io
import json
import shutil
import time

import pytest
import redis

from app import create_app
from llmq import fleet
from llmq.events import WORKERS_KEY
from llmq.settings import Settings

MODEL = "stories260k"
BODY = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4}


@pytest.fixture()
def client(tmp_path, redis_url, migrated_db, stories_dir):
    shutil.copy(migrated_db, tmp_path / "llmq.db")
    redis.Redis.from_url(redis_url).flushdb()
    settings = Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'llmq.db'}", redis_url=redis_url,
                        model_path=str(stories_dir), model_name=MODEL, heartbeat_seconds=1)
    return create_app(settings).test_client()


def beat(r: redis.Redis, model: str, state: str, age_s: float = 0.0) -> None:
    r.hset(WORKERS_KEY, f"w-{model}-{state}", json.dumps({"model": model, "state": state, "at": time.time() - age_s}))


def create_batch(client):
    """POST /v1/batches of a one-line file (it answers at once, where a completion waits for its tokens)."""
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": BODY}).encode()
    upload = client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(line), "in.jsonl")})
    return client.post("/v1/batches", json={"input_file_id": upload.json["id"], "endpoint": "/v1/completions",
                                            "completion_window": "24h"})


def test_nothing_serves_the_model_503_for_completions_and_batches(client, redis_url):
    for stream in (False, True):
        answer = client.post("/v1/completions", json={**BODY, "stream": stream})
        assert answer.status_code == 503
        assert answer.json["error"]["code"] == "model_not_served"
        assert answer.json["error"]["param"] == "model"
        assert "llmq autoscale" in answer.json["error"]["message"]
    created = create_batch(client)
    assert created.status_code == 503 and created.json["error"]["code"] == "model_not_served"
    assert client.get("/v1/batches").json["data"] == [], "nothing is stored for a refused batch"


@pytest.mark.parametrize("state", ["starting", "ready"])
def test_a_live_worker_of_the_model_is_enough(client, redis_url, state):
    beat(redis.Redis.from_url(redis_url), MODEL, state)
    assert create_batch(client).status_code == 200


def test_a_dead_worker_or_one_of_another_model_is_not(client, redis_url):
    r = redis.Redis.from_url(redis_url)
    beat(r, MODEL, "ready", age_s=60)  # older than 3 heartbeats + 5 s
    beat(r, "another-model", "ready")
    assert create_batch(client).status_code == 503


def test_an_autoscaler_that_may_start_a_worker_is_enough_even_at_zero_workers(client, redis_url):
    r = redis.Redis.from_url(redis_url)
    fleet.write_autoscaler(r, MODEL, {"desired": 0, "actual": 0, "min": 0, "max": 0, "backend": "local"})
    assert create_batch(client).status_code == 503, "an autoscaler whose maximum is 0"
    fleet.write_autoscaler(r, MODEL, {"desired": 0, "actual": 0, "min": 0, "max": 2, "backend": "local"})
    assert create_batch(client).status_code == 200
