"""Per-key limits: requests and tokens per minute (429 with Retry-After, counted in Redis so two web
processes share them), upload size (413), lines per batch file, max_tokens. Server-wide defaults
from the settings (LLMQ_*), a key's own values over them.

Real Redis, a real migrated SQLite database, the real app. POST /v1/requests is the submission used:
it answers 202 without a worker, and its task waits on the real broker queue.
"""
from __future__ import annotations

import io
import json
import time

import pytest
import redis

from app import limits
from llmq.settings import Settings
from llmq.store.models import Request

MODEL = "stories260k"


def submit(client, headers=None, **body):
    return client.post("/v1/requests", headers=headers or {},
                       json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 5, **body})


def upload(client, content: bytes, headers=None):
    return client.post("/v1/files", headers=headers or {},
                       data={"purpose": "batch", "file": (io.BytesIO(content), "in.jsonl")})


def assert_error(response, status: int, code: str, param=None, error_type=None) -> str:
    assert response.status_code == status, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["code"], error["param"]) == (code, param)
    if error_type:
        assert error["type"] == error_type
    return error["message"]


def assert_rate_limited(response, words: str) -> int:
    message = assert_error(response, 429, "rate_limit_exceeded", error_type="rate_limit_error")
    assert words in message
    retry_after = int(response.headers["Retry-After"])
    assert 1 <= retry_after <= 60 and f"Try again in {retry_after} s" in message
    return retry_after


def count_requests(app) -> int:
    with app.extensions["llmq"].db.session() as session:
        return session.query(Request).count()


def test_settings_read_the_limit_variables(monkeypatch):
    for name, value in (("LLMQ_RATE_LIMIT_RPM", "60"), ("LLMQ_RATE_LIMIT_TPM", "9000"),
                        ("LLMQ_MAX_TOKENS_LIMIT", "512"), ("LLMQ_MAX_UPLOAD_BYTES", "1000"),
                        ("LLMQ_MAX_BATCH_LINES", "7")):
        monkeypatch.setenv(name, value)
    settings = Settings.from_env()
    assert (settings.rate_limit_rpm, settings.rate_limit_tpm, settings.max_tokens_limit,
            settings.max_upload_bytes, settings.max_batch_lines) == (60, 9000, 512, 1000, 7)


def test_requests_per_minute_on_an_open_install(make_app):
    app = make_app(rate_limit_rpm=3)
    client = app.test_client()
    assert [client.get("/v1/models").status_code for _ in range(3)] == [200, 200, 200]
    assert_rate_limited(client.get("/v1/files"), "3 requests per minute")
    assert client.get("/health").status_code == 200  # never counted, never limited


def test_a_keys_own_rate_overrides_the_default_and_keys_are_counted_apart(make_app, new_key):
    app = make_app(rate_limit_rpm=100)
    client = app.test_client()
    _, slow = new_key(app, "acme", rate_limit_rpm=2)
    _, unlimited = new_key(app, "acme", rate_limit_rpm=0)
    _, default = new_key(app, "acme")
    assert [client.get("/v1/models", headers=slow).status_code for _ in range(2)] == [200, 200]
    assert_rate_limited(client.get("/v1/models", headers=slow), "2 requests per minute")
    assert all(client.get("/v1/models", headers=unlimited).status_code == 200 for _ in range(5))
    assert client.get("/v1/models", headers=default).status_code == 200


def test_limits_hold_across_two_web_processes(make_app, new_key):
    first, second = make_app(), make_app()  # two apps on one database and one Redis, as two gunicorn workers
    _, headers = new_key(first, "acme", rate_limit_rpm=4, rate_limit_tpm=30)
    clients = [first.test_client(), second.test_client()]
    # tokens: 3 prompt + 5 max_tokens = 8 per submission; 3 of them use 24 of 30
    assert [submit(clients[i % 2], headers).status_code for i in range(3)] == [202, 202, 202]
    assert_rate_limited(submit(clients[1], headers), "30 tokens per minute (this request needs 8)")
    assert_rate_limited(clients[0].get("/v1/models", headers=headers), "4 requests per minute")
    assert count_requests(first) == 3


def test_tokens_per_minute_count_prompts_and_max_tokens_times_choices(make_app, new_key):
    app = make_app()
    client = app.test_client()
    _, headers = new_key(app, "acme", rate_limit_tpm=40)
    # two prompts of 3 tokens, n=2, max_tokens 5: 2*3 + 5*2*2 = 26 tokens
    assert submit(client, headers, prompt=[[1, 2, 3], [4, 5, 6]], n=2).status_code == 202
    assert_rate_limited(submit(client, headers, prompt=[[1, 2, 3], [4, 5, 6]], n=2), "needs 26")
    assert submit(client, headers, max_tokens=11).status_code == 202  # 3 + 11 = 14: 40 used exactly
    assert count_requests(app) == 2

    message = assert_error(submit(client, headers, max_tokens=100), 400, "tokens_per_minute_exceeded", "max_tokens")
    assert "needs 103 tokens" in message and "40 tokens per minute" in message


def test_the_window_ends_and_requests_pass_again(make_app, monkeypatch):
    monkeypatch.setattr(limits, "WINDOW_MS", 1200)  # a short window, so the test need not wait a minute
    app = make_app(rate_limit_rpm=1)
    client = app.test_client()
    assert client.get("/v1/models").status_code == 200
    assert_rate_limited(client.get("/v1/models"), "1 requests per minute")
    time.sleep(1.3)
    assert client.get("/v1/models").status_code == 200


def test_upload_size_per_key(make_app, new_key):
    app = make_app(max_upload_bytes=4096)
    client = app.test_client()
    _, small = new_key(app, "acme", max_upload_bytes=300)
    _, large = new_key(app, "acme", max_upload_bytes=100_000)
    _, default = new_key(app, "acme")
    content = b"{}\n" * 200  # 600 bytes
    # The file's own bytes are held to the limit exactly (its multipart framing aside): the 413 names it.
    message = assert_error(upload(client, content, small), 413, "request_too_large", "file")
    assert "at most 300 bytes" in message
    assert upload(client, content, default).status_code == 200
    big = b"{}\n" * 3000  # 9000 bytes: over the server's default, within the large key's own limit
    assert_error(upload(client, big, default), 413, "request_too_large", "file")
    assert upload(client, big, large).status_code == 200


def test_lines_per_batch_file_per_key(make_app, new_key):
    app = make_app(max_batch_lines=100)
    client = app.test_client()
    _, headers = new_key(app, "acme", max_batch_lines=2)
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}})
    assert upload(client, f"{line}\n\n{line}\n".encode(), headers).status_code == 200  # blank lines do not count
    message = assert_error(upload(client, f"{line}\n{line}\n{line}\n".encode(), headers), 400, "too_many_lines", "file")
    assert "has 3 request lines" in message and "at most 2" in message
    # The workers refuse files over LLMQ_MAX_BATCH_LINES whatever a key says: a key cannot raise it.
    _, generous = new_key(app, "acme", max_batch_lines=1000)
    assert_error(upload(client, (line + "\n").encode() * 101, generous), 400, "too_many_lines", "file")


def test_max_tokens_per_key_and_server_wide(make_app, new_key):
    app = make_app(max_tokens_limit=50)
    client = app.test_client()
    _, headers = new_key(app, "acme", max_tokens=8)
    message = assert_error(submit(client, headers, max_tokens=9), 400, "max_tokens_exceeded", "max_tokens")
    assert "max_tokens is 9" in message and "at most 8" in message
    assert submit(client, headers, max_tokens=8).status_code == 202
    assert_error(submit(client, max_tokens=51), 401, "invalid_api_key")  # keys exist now: the default needs one
    _, default = new_key(app, "acme")
    assert_error(submit(client, default, max_tokens=51), 400, "max_tokens_exceeded", "max_tokens")
    assert submit(client, default, max_tokens=50).status_code == 202
    assert count_requests(app) == 2


def test_a_batch_carries_its_keys_max_tokens_limit_to_the_workers(make_app, new_key):
    """The web cannot see inside a batch's lines' run; it stamps the key's limit on the batch, and the
    worker that expands the file turns each line asking for more into an error line
    (tests/test_batch_lifecycle.py checks that side)."""
    from llmq.store.models import Batch

    app = make_app()
    client = app.test_client()
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}})
    limits_by_key = {}
    for max_tokens in (8, None):
        _, headers = new_key(app, "acme", **({"max_tokens": max_tokens} if max_tokens else {}))
        file_id = upload(client, (line + "\n").encode(), headers).get_json()["id"]
        batch = client.post("/v1/batches", headers=headers, json={"input_file_id": file_id,
                                                                  "endpoint": "/v1/completions",
                                                                  "completion_window": "24h"}).get_json()
        with app.extensions["llmq"].db.read() as session:
            limits_by_key[max_tokens] = session.get(Batch, batch["id"]).max_tokens_limit
    assert limits_by_key == {8: 8, None: None}


@pytest.fixture
def chat_model_dir(tmp_path, stories_dir):
    """stories260k with a chat template, so chat completions get as far as their limits."""
    import shutil

    folder = tmp_path / "stories-chat"
    shutil.copytree(stories_dir, folder)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return folder


@pytest.mark.parametrize("path,field", [("/v1/completions", "max_tokens"), ("/v1/chat/completions", "max_tokens"),
                                        ("/v1/chat/completions", "max_completion_tokens")])
def test_refused_submissions_queue_nothing(make_app, redis_url, chat_model_dir, path, field):
    app = make_app(max_tokens_limit=4, model_path=str(chat_model_dir))
    body = {"model": MODEL, field: 5}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    message = assert_error(app.test_client().post(path, json=body), 400, "max_tokens_exceeded", field)
    assert f"{field} is 5" in message
    assert count_requests(app) == 0 and redis.Redis.from_url(redis_url).llen(f"llmq.{MODEL}") == 0


def test_one_requests_size_per_key_and_server_wide(make_app, new_key):
    app = make_app(max_request_choices=4, max_request_tokens=60)
    client = app.test_client()
    _, default = new_key(app, "acme")
    _, roomy = new_key(app, "acme", max_request_choices=0, max_request_tokens=1000)  # 0: no limit of choices
    # three prompts of 3 tokens, n=2: 6 choices
    message = assert_error(submit(client, default, prompt=[[1, 2, 3]] * 3, n=2), 400, "request_too_large", "n")
    assert "6 choices" in message and "at most 4" in message
    assert submit(client, roomy, prompt=[[1, 2, 3]] * 3, n=2).status_code == 202
    # 2 prompts of 3 tokens, n=2, max_tokens 20: 6 + 80 = 86 tokens
    message = assert_error(submit(client, default, prompt=[[1, 2, 3]] * 2, n=2, max_tokens=20), 400,
                           "request_too_large", "max_tokens")
    assert "86 tokens" in message and "at most 60" in message
    assert submit(client, default, prompt=[[1, 2, 3]] * 2, n=2, max_tokens=10).status_code == 202  # 46 tokens
    assert count_requests(app) == 2
