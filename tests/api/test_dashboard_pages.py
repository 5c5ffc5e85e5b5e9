"""The dashboard on the real app, a real Redis and a migrated SQLite database (no worker: the batch
bookkeeping a worker does runs through llmq.store.batch_lifecycle). What a page shows, who sees
it, the session and its cookie, the CSRF token on every form and on API calls made with the
session. The browser test (tests/service/test_dashboard_browser.py) drives the same pages in
Chromium against the whole service."""
from __future__ import annotations

import io
import json
import re
import time

import pytest

from app.api import batches as batches_api
from app.api import common
from llmq.store import batch_lifecycle
from llmq.store.api_keys import revoke_key
from llmq.store.models import Batch

MODEL = "stories260k"


def line(custom_id: str, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"model": MODEL, "prompt": "Once", "max_tokens": 2, **body}})


GOOD_FILE = ("\n".join(line(f"q{i}") for i in range(3)) + "\n").encode()


@pytest.fixture
def queued(monkeypatch):
    """Replaces `enqueue` (there is no worker here): the tasks the web sent, in order."""
    sent = []

    def enqueue(task, args, model):
        sent.append((task, args))

    monkeypatch.setattr(common, "enqueue", enqueue)  # requests
    monkeypatch.setattr(batches_api, "enqueue", enqueue)  # batches (imported by name there)
    return sent


def csrf(client, path: str = "/dashboard/batches") -> str:
    page = client.get(path)
    assert page.status_code == 200, page.get_data(as_text=True)
    return re.search(r'name="csrf-token" content="([^"]+)"', page.get_data(as_text=True)).group(1)


def upload(client, content: bytes, token: str, **fields):
    return client.post("/dashboard/batches", data={"csrf_token": token, "endpoint": "/v1/completions",
                                                   "file": (io.BytesIO(content), "prompts.jsonl"), **fields})


def log_in(client, secret: str):
    return client.post("/dashboard/login", data={"csrf_token": csrf(client, "/dashboard/login"), "api_key": secret,
                                                 "next": "/dashboard/batches"})


def run_to_the_end(app, batch_id: str) -> None:
    web = app.extensions["llmq"]
    with web.db.session() as session:
        item_ids = batch_lifecycle.expand_input(session, session.get(Batch, batch_id), web.model, web.tokenizer, 100)
    for item_id in item_ids:
        with web.db.session() as session:
            batch_lifecycle.record_result(session, item_id, "completed", batch_lifecycle.success_line(
                f"q{item_id}", {"id": "x", "choices": [{"index": 0, "text": " upon a time", "finish_reason": "length"}]}))
    with web.db.session() as session:
        batch_lifecycle.finalize_if_done(session, batch_id)


# ---- an open install ------------------------------------------------------------------------

def test_an_open_install_needs_no_log_in_and_its_session_cookie_is_httponly_and_samesite(client):
    page = client.get("/dashboard/batches")
    assert page.status_code == 200
    assert "No batches yet" in page.get_data(as_text=True) and "open install" in page.get_data(as_text=True)
    cookie = page.headers["Set-Cookie"]  # the CSRF token lives in the session
    assert cookie.startswith("llmq_session=") and "HttpOnly" in cookie and "SameSite=Lax" in cookie
    assert "Secure" not in cookie  # plain HTTP: a browser would not send a Secure cookie back


def test_the_session_cookie_is_secure_over_https(client):
    cookie = client.get("/dashboard/batches", base_url="https://localhost").headers["Set-Cookie"]
    assert "Secure" in cookie


def test_a_form_without_the_csrf_token_changes_nothing(client, queued):
    refused = client.post("/dashboard/batches", data={"file": (io.BytesIO(GOOD_FILE), "x.jsonl")})
    assert refused.status_code == 400 and "CSRF token is missing" in refused.get_data(as_text=True)
    wrong = upload(client, GOOD_FILE, "not-the-token")
    assert wrong.status_code == 400
    assert queued == [] and client.get("/v1/batches").get_json()["data"] == []


def test_an_upload_with_bad_lines_is_refused_with_their_numbers_and_makes_no_batch(client, queued):
    content = "\n".join([line("ok"), "{not json", line("ok"), line("big", max_tokens=-3)]).encode()
    page = upload(client, content, csrf(client))
    text = page.get_data(as_text=True)
    assert page.status_code == 400
    messages = re.findall(r"<li>(line [^<]+)</li>", text)
    assert [m.split(":")[0].split()[1] for m in messages] == ["2", "3", "4"]  # bad JSON, duplicate custom_id, max_tokens
    assert "not valid JSON" in messages[0] and "appears earlier" in messages[1] and "max_tokens" in messages[2]
    assert queued == [] and client.get("/v1/files").get_json()["data"] == []


def test_bad_lines_run_anyway_when_asked_and_become_error_lines(app, client, queued):
    content = "\n".join([line("ok"), "{not json"]).encode()
    page = upload(client, content, csrf(client), run_anyway="1")
    assert page.status_code == 302
    batch_id = page.headers["Location"].rsplit("/", 1)[1]
    assert queued == [("llmq.run_batch", [batch_id])]


def test_an_uploaded_batch_shows_its_progress_lines_and_files(app, client, queued):
    created = upload(client, GOOD_FILE, csrf(client))
    assert created.status_code == 302
    batch_id = created.headers["Location"].rsplit("/", 1)[1]
    assert queued == [("llmq.run_batch", [batch_id])]
    listed = client.get("/dashboard/batches/table").get_data(as_text=True)
    assert batch_id in listed and 'data-status="validating"' in listed and 'data-live="true"' in listed
    run_to_the_end(app, batch_id)
    page = client.get(f"/dashboard/batches/{batch_id}").get_data(as_text=True)
    assert 'id="batch-status">completed' in page and 'aria-valuenow="100"' in page
    assert re.search(r'id="count-completed">3<', page) and re.search(r'id="count-total">3<', page)
    assert page.count('data-status="completed"') == 3 and " upon a time" in page
    output = re.search(r'id="download-output" href="([^"]+)"', page).group(1)
    downloaded = client.get(output)
    assert downloaded.status_code == 200 and len(downloaded.data.splitlines()) == 3
    summary = client.get(f"/dashboard/batches/{batch_id}/summary").get_data(as_text=True)
    assert 'data-live="false"' in summary  # finished: the page stops refreshing
    only_failed = client.get(f"/dashboard/batches/{batch_id}?status=failed").get_data(as_text=True)
    assert 'data-status="completed"' not in only_failed and "No lines failed" in only_failed


def test_cancel_from_the_batch_page(app, client, queued):
    batch_id = upload(client, GOOD_FILE, csrf(client)).headers["Location"].rsplit("/", 1)[1]
    web = app.extensions["llmq"]
    with web.db.session() as session:
        batch_lifecycle.expand_input(session, session.get(Batch, batch_id), web.model, web.tokenizer, 100)
    page = client.get(f"/dashboard/batches/{batch_id}").get_data(as_text=True)
    token = re.search(r'name="csrf-token" content="([^"]+)"', page).group(1)
    assert 'id="cancel-batch"' in page
    done = client.post(f"/dashboard/batches/{batch_id}/cancel", data={"csrf_token": token})
    assert done.status_code == 302
    assert client.get(f"/v1/batches/{batch_id}").get_json()["status"] == "cancelled"
    assert 'id="cancel-batch"' not in client.get(f"/dashboard/batches/{batch_id}").get_data(as_text=True)


# ---- with API keys ----------------------------------------------------------------------------

def test_once_keys_exist_a_page_leads_to_the_log_in_and_a_bad_key_is_told_why(app, client, new_key):
    new_key(app, "acme")
    page = client.get("/dashboard/batches")
    assert page.status_code == 302 and "/dashboard/login" in page.headers["Location"]
    refused = log_in(client, "llmq-" + "x" * 43)
    assert refused.status_code == 401 and "Incorrect API key provided" in refused.get_data(as_text=True)
    malformed = log_in(client, "sk-wrong")
    assert malformed.status_code == 401 and "Malformed API key" in malformed.get_data(as_text=True)
    assert client.get("/dashboard/workers").status_code == 302


def test_a_tenant_sees_only_its_own_batches(app, client, new_key, queued):
    _, acme = new_key(app, "acme")
    _, globex = new_key(app, "globex")
    file_id = client.post("/v1/files", headers=globex, data={
        "purpose": "batch", "file": (io.BytesIO(GOOD_FILE), "g.jsonl")}).get_json()["id"]
    theirs = client.post("/v1/batches", headers=globex, json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                               "completion_window": "24h"}).get_json()["id"]
    assert log_in(client, acme["Authorization"].split()[1]).status_code == 302
    ours = upload(client, GOOD_FILE, csrf(client)).headers["Location"].rsplit("/", 1)[1]
    listed = client.get("/dashboard/batches").get_data(as_text=True)
    assert ours in listed and theirs not in listed and "tenant <strong>acme</strong>" in listed
    other = client.get(f"/dashboard/batches/{theirs}")
    assert other.status_code == 404 and f"No batch found with id &#39;{theirs}&#39;" in other.get_data(as_text=True)


def test_api_calls_made_with_the_session_need_its_csrf_token(app, client, new_key, queued):
    _, acme = new_key(app, "acme")
    log_in(client, acme["Authorization"].split()[1])
    assert client.get("/v1/batches").status_code == 200  # a read needs only the session
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 2}
    refused = client.post("/v1/requests", json=body)
    assert refused.status_code == 403 and refused.get_json()["error"]["code"] == "csrf_failed"
    accepted = client.post("/v1/requests", json=body, headers={"X-CSRFToken": csrf(client)})
    assert accepted.status_code == 202, accepted.get_json()
    assert client.get(f"/v1/requests/{accepted.get_json()['id']}", headers=acme).status_code == 200  # acme's


def test_revoking_the_key_ends_its_sessions(app, client, new_key):
    key_id, acme = new_key(app, "acme")
    log_in(client, acme["Authorization"].split()[1])
    assert client.get("/dashboard/batches").status_code == 200
    with app.extensions["llmq"].db.session() as session:
        revoke_key(session, key_id)
    assert client.get("/dashboard/batches").status_code == 302
    assert client.get("/v1/batches").status_code == 401


def test_log_in_never_sends_a_person_to_another_site(app, client, new_key):
    _, acme = new_key(app, "acme")
    token = csrf(client, "/dashboard/login")
    answer = client.post("/dashboard/login", data={"csrf_token": token, "api_key": acme["Authorization"].split()[1],
                                                   "next": "//evil.example/x"})
    assert answer.status_code == 302 and answer.headers["Location"] == "/dashboard/batches"


# ---- the workers page ----------------------------------------------------------------------------

def test_the_workers_page_shows_each_worker_and_the_last_hour(app, client, redis_url):
    import redis

    from llmq import fleet, fleet_history
    from llmq.events import WORKERS_KEY

    r = redis.Redis.from_url(redis_url)
    now = time.time()
    r.hset(WORKERS_KEY, "w1@host", json.dumps({
        "instance": "w1@host:1", "model": MODEL, "state": "ready", "at": now, "running": 3, "waiting": 1,
        "free_blocks": 25, "total_blocks": 100, "tokens_per_s": 812.5, "dtype": "bfloat16", "quantization": "int8",
        "tensor_parallel_size": 2, "pipeline_parallel_size": 1, "host": "host", "pid": 7}))
    assert fleet_history.record(r, MODEL, stale_after=30, now=now)
    page = client.get("/dashboard/workers").get_data(as_text=True)
    assert 'data-worker="w1@host"' in page and "int8" in page and "2 × 1" in page and "<td>bfloat16</td>" in page
    assert 'aria-valuenow="75"' in page  # 75 of 100 blocks in use
    assert "812" in page and "none running" in page  # no autoscaler
    assert page.count('<polyline class="workers"') == 1 and "1 samples" in page
    fleet.write_autoscaler(r, MODEL, {"desired": 3, "actual": 1, "min": 0, "max": 4, "backend": "local"})
    assert fleet_history.record(r, MODEL, stale_after=30, now=now + fleet_history.BUCKET_S)
    page = client.get("/dashboard/workers/fleet").get_data(as_text=True)
    assert '<dd class="autoscaler">3 / 1</dd>' in page and "0 to 4 (local)" in page
    assert page.count('<polyline class="desired"') == 1 and "2 samples" in page
