"""completion_window: OpenAI's "24h", and any whole number of seconds, minutes or hours up to a week;
a batch polled after its window is expired at once, even with no worker to sweep."""
from __future__ import annotations

import io
import json
import shutil
import time

import pytest

from app import create_app
from llmq.settings import Settings


@pytest.fixture()
def client(tmp_path, redis_url, migrated_db, stories_dir):
    db = tmp_path / "llmq.db"
    shutil.copy(migrated_db, db)
    settings = Settings(home=tmp_path, database_url=f"sqlite:///{db}", redis_url=redis_url,
                        model_path=str(stories_dir), model_name="stories260k")
    return create_app(settings).test_client()


def create(client, window: str):
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": "Once upon a time", "max_tokens": 4}})
    file_id = client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(line.encode()), "in.jsonl")}
                          ).get_json()["id"]
    return client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                            "completion_window": window})


@pytest.mark.parametrize(("window", "seconds"), [("24h", 86400), ("90s", 90), ("30m", 1800), ("168h", 604800)])
def test_windows_in_seconds_minutes_or_hours(client, window, seconds):
    batch = create(client, window).get_json()
    assert batch["completion_window"] == window
    assert batch["expires_at"] - batch["created_at"] in (seconds, seconds + 1)  # whole unix seconds


def test_a_batch_polled_after_its_window_is_expired(client):
    batch = create(client, "1s").get_json()
    assert batch["status"] == "validating"
    time.sleep(2.1)
    polled = client.get(f"/v1/batches/{batch['id']}").get_json()
    assert polled["status"] == "expired" and polled["expired_at"] >= batch["expires_at"]
    assert polled["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
