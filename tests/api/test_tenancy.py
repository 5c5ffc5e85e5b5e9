"""Tenancy: each key belongs to a tenant, and a tenant sees only its own files, batches, requests and
streams. Another tenant's id answers exactly what an id that exists nowhere answers (status and
body, the id aside), so ids reveal nothing; lists show only the caller's rows.

Real Redis, a real migrated SQLite database, the real app; the batch bookkeeping a worker would do
runs through llmq.store.batch_lifecycle, as in test_files_batches_api.py.
"""
from __future__ import annotations

import io
import json

import pytest
import redis

from llmq.events import DeltaEvent, cancel_key
from llmq.store import batch_lifecycle
from llmq.store.models import Batch, Request
from llmq.streams import publish_events

MODEL = "stories260k"
BATCH_INPUT = (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                           "body": {"model": MODEL, "prompt": "Once", "max_tokens": 2}}) + "\n").encode()


@pytest.fixture
def acme(app, new_key):
    return new_key(app, "acme")[1]


@pytest.fixture
def globex(app, new_key):
    return new_key(app, "globex")[1]


def upload(client, headers, content: bytes = BATCH_INPUT):
    response = client.post("/v1/files", headers=headers,
                           data={"purpose": "batch", "file": (io.BytesIO(content), "in.jsonl")})
    assert response.status_code == 200, response.get_json()
    return response.get_json()["id"]


def create_batch(client, headers, file_id: str):
    return client.post("/v1/batches", headers=headers, json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                             "completion_window": "24h"})


def finished_batch(app, client, headers) -> dict:
    """A batch of `headers`' tenant that has run to the end: its output file exists."""
    batch_id = create_batch(client, headers, upload(client, headers)).get_json()["id"]
    with app.extensions["llmq"].db.session() as session:
        [item_id] = batch_lifecycle.expand_input(session, session.get(Batch, batch_id), app.extensions["llmq"].model, app.extensions["llmq"].tokenizer, max_lines=10)
    with app.extensions["llmq"].db.session() as session:
        batch_lifecycle.record_result(session, item_id, "completed", batch_lifecycle.success_line("a", {"id": "x"}))
        assert batch_lifecycle.finalize_if_done(session, batch_id) == "completed"
    return client.get(f"/v1/batches/{batch_id}", headers=headers).get_json()


def normalized(response, object_id: str) -> tuple[int, str]:
    return response.status_code, response.get_data(as_text=True).replace(object_id, "<id>")


def assert_same_as_unknown(call, own_id: str, unknown_id: str) -> None:
    """`call(id)` with another tenant's id answers exactly what it answers for an id that exists nowhere."""
    foreign, unknown = normalized(call(own_id), own_id), normalized(call(unknown_id), unknown_id)
    assert foreign == unknown
    assert foreign[0] in (400, 404), foreign


def test_another_tenants_ids_answer_as_unknown_ids(app, client, acme, globex, redis_url):
    file_id = upload(client, acme)
    batch_id = create_batch(client, acme, file_id).get_json()["id"]
    output_file_id = finished_batch(app, client, acme)["output_file_id"]
    request_id = client.post("/v1/requests", headers=acme, json={"model": MODEL, "prompt": "Once", "max_tokens": 2}
                             ).get_json()["id"]
    publish_events(redis.Redis.from_url(redis_url), request_id, [DeltaEvent(0, "secret", (5,), t=1.0)],
                   maxlen=100, ttl=60)

    calls = {
        "GET file": lambda i: client.get(f"/v1/files/{i}", headers=globex),
        "GET file content": lambda i: client.get(f"/v1/files/{i}/content", headers=globex),
        "DELETE file": lambda i: client.delete(f"/v1/files/{i}", headers=globex),
        "POST batch from file": lambda i: create_batch(client, globex, i),
    }
    for call in calls.values():
        for own_id in (file_id, output_file_id):
            assert_same_as_unknown(call, own_id, "file-" + "0" * 24)
    batch_calls = {
        "GET batch": lambda i: client.get(f"/v1/batches/{i}", headers=globex),
        "POST batch cancel": lambda i: client.post(f"/v1/batches/{i}/cancel", headers=globex),
        "GET batches after": lambda i: client.get(f"/v1/batches?after={i}", headers=globex),
    }
    for call in batch_calls.values():
        assert_same_as_unknown(call, batch_id, "batch_" + "0" * 24)
    request_calls = {
        "GET request": lambda i: client.get(f"/v1/requests/{i}", headers=globex),
        "GET request events": lambda i: client.get(f"/v1/requests/{i}/events", headers=globex),
        "POST request cancel": lambda i: client.post(f"/v1/requests/{i}/cancel", headers=globex),
    }
    for call in request_calls.values():
        assert_same_as_unknown(call, request_id, "cmpl-" + "0" * 24)

    # Nothing globex tried changed acme's objects, and acme still reaches every one of them.
    assert client.get(f"/v1/files/{file_id}/content", headers=acme).data == BATCH_INPUT
    assert client.get(f"/v1/files/{output_file_id}/content", headers=acme).status_code == 200
    assert client.get(f"/v1/batches/{batch_id}", headers=acme).get_json()["status"] == "validating"
    polled = client.get(f"/v1/requests/{request_id}", headers=acme).get_json()
    assert (polled["status"], polled["text"]) == ("queued", "secret")
    assert not redis.Redis.from_url(redis_url).exists(cancel_key(request_id))
    with app.extensions["llmq"].db.session() as session:
        assert session.query(Batch).filter_by(tenant="globex").count() == 0


def test_rows_and_output_files_belong_to_the_callers_tenant(app, client, acme, globex):
    batch = finished_batch(app, client, globex)
    request_id = client.post("/v1/requests", headers=globex, json={"model": MODEL, "prompt": "x"}).get_json()["id"]
    output = client.get(f"/v1/files/{batch['output_file_id']}", headers=globex).get_json()
    assert output["purpose"] == "batch_output"
    with app.extensions["llmq"].db.session() as session:
        assert session.get(Batch, batch["id"]).tenant == "globex"
        assert session.get(Request, request_id).tenant == "globex"


def test_lists_show_only_the_callers_rows(app, client, acme, globex):
    acme_files = {upload(client, acme), upload(client, acme)}
    globex_file = upload(client, globex)
    acme_batches = {create_batch(client, acme, file_id).get_json()["id"] for file_id in acme_files}
    globex_batch = create_batch(client, globex, globex_file).get_json()["id"]

    assert {f["id"] for f in client.get("/v1/files", headers=acme).get_json()["data"]} == acme_files
    assert [f["id"] for f in client.get("/v1/files", headers=globex).get_json()["data"]] == [globex_file]
    acme_listing = client.get("/v1/batches", headers=acme).get_json()
    assert {b["id"] for b in acme_listing["data"]} == acme_batches and acme_listing["has_more"] is False
    assert [b["id"] for b in client.get("/v1/batches", headers=globex).get_json()["data"]] == [globex_batch]
    first_page = client.get("/v1/batches?limit=1", headers=acme).get_json()
    assert first_page["has_more"] is True
    second_page = client.get(f"/v1/batches?limit=1&after={first_page['last_id']}", headers=acme).get_json()
    assert second_page["has_more"] is False and second_page["data"][0]["id"] in acme_batches


def test_rows_from_before_keys_belong_to_tenant_default(app, client, new_key):
    file_id = upload(client, {})  # an open install: tenant "default"
    _, acme = new_key(app, "acme")
    _, default = new_key(app, "default")
    assert client.get(f"/v1/files/{file_id}", headers=acme).status_code == 404
    assert client.get(f"/v1/files/{file_id}", headers=default).status_code == 200
