"""Files and Batches API, with no worker: the web process against a real Redis server and a migrated
SQLite database. What a worker would do is driven here through the torch-free bookkeeping
(llmq.store.batch_lifecycle), so the batch states the API shows are checked exactly.
"""
from __future__ import annotations

import base64
import io
import json
import shutil

import pytest
import redis
from sqlalchemy import select

from app import create_app
from app.limits import MULTIPART_ALLOWANCE_BYTES
from llmq.events import cancel_key
from llmq.settings import Settings, queue_name
from llmq.store import batch_lifecycle
from llmq.store.models import Batch, BatchItem, File

MODEL = "stories260k"
MAX_UPLOAD = 4096
QUEUE = queue_name(MODEL)


# ---- fixtures -------------------------------------------------------------------------------

@pytest.fixture
def app(tmp_path, migrated_db, redis_url, stories_dir):
    db_path = tmp_path / "t.db"
    shutil.copy(migrated_db, db_path)
    redis.Redis.from_url(redis_url).flushdb()
    settings = Settings(home=tmp_path, database_url=f"sqlite:///{db_path}", redis_url=redis_url,
                        model_path=str(stories_dir), model_name=MODEL, max_upload_bytes=MAX_UPLOAD)
    flask_app = create_app(settings)
    flask_app.config["TESTING"] = True
    yield flask_app
    flask_app.extensions["llmq"].celery.close()
    flask_app.extensions["llmq"].db.engine.dispose()


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture
def broker(redis_url):
    return redis.Redis.from_url(redis_url)


# ---- helpers --------------------------------------------------------------------------------

def line(custom_id: str, prompt: str = "Once upon a time") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"model": MODEL, "prompt": prompt, "max_tokens": 4}})


GOOD_INPUT = ("\n".join(line(f"r{i}") for i in range(3)) + "\n").encode()


def upload(client, content: bytes = GOOD_INPUT, filename: str = "in.jsonl", purpose: str | None = "batch"):
    data = {"file": (io.BytesIO(content), filename)}
    if purpose is not None:
        data["purpose"] = purpose
    return client.post("/v1/files", data=data)


def create_batch(client, file_id: str, **fields):
    body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h", **fields}
    return client.post("/v1/batches", json=body)


def new_batch(client, content: bytes = GOOD_INPUT) -> dict:
    file_id = upload(client, content).get_json()["id"]
    response = create_batch(client, file_id)
    assert response.status_code == 200, response.get_json()
    return response.get_json()


def assert_error(response, status: int, param: str | None, code: str | None = None) -> dict:
    assert response.status_code == status, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    return error


# ---- files ----------------------------------------------------------------------------------

def test_file_upload_get_list_content_delete(client):
    response = upload(client)
    assert response.status_code == 200
    file = response.get_json()
    assert file["id"].startswith("file-")
    assert file == {"id": file["id"], "object": "file", "bytes": len(GOOD_INPUT), "created_at": file["created_at"],
                    "filename": "in.jsonl", "purpose": "batch", "status": "processed", "expires_at": None}
    assert isinstance(file["created_at"], int)

    assert client.get(f"/v1/files/{file['id']}").get_json() == file
    other = upload(client, b"{}\n", filename="other.jsonl").get_json()
    listing = client.get("/v1/files").get_json()
    assert listing == {"object": "list", "data": [other, file], "has_more": False}  # newest first
    assert client.get("/v1/files?purpose=batch_output").get_json()["data"] == []

    content = client.get(f"/v1/files/{file['id']}/content")
    assert content.status_code == 200
    assert content.data == GOOD_INPUT
    assert content.mimetype == "application/octet-stream"

    deleted = client.delete(f"/v1/files/{file['id']}")
    assert deleted.status_code == 200
    assert deleted.get_json() == {"id": file["id"], "object": "file", "deleted": True}
    assert_error(client.get(f"/v1/files/{file['id']}"), 404, "id", "not_found")
    assert_error(client.get(f"/v1/files/{file['id']}/content"), 404, "id", "not_found")
    assert_error(client.delete(f"/v1/files/{file['id']}"), 404, "id", "not_found")
    assert [f["id"] for f in client.get("/v1/files").get_json()["data"]] == [other["id"]]


def test_a_file_of_exactly_the_limit_is_taken_its_multipart_framing_aside(client):
    assert upload(client, b"x" * MAX_UPLOAD).status_code == 200


def test_a_body_cut_short_by_the_limit_closes_its_connection_saying_so(client):
    response = upload(client, b"x" * (MAX_UPLOAD + MULTIPART_ALLOWANCE_BYTES + 1))
    assert response.status_code == 413 and response.headers["Connection"] == "close"
    assert f"at most {MAX_UPLOAD} bytes" in response.get_json()["error"]["message"]


def test_upload_over_the_limit_is_413_in_the_openai_shape(client):
    error = assert_error(upload(client, b"x" * (MAX_UPLOAD + 1)), 413, "file", "request_too_large")
    assert "LLMQ_MAX_UPLOAD_BYTES" in error["message"]
    assert client.get("/v1/files").get_json()["data"] == []


def test_upload_needs_purpose_batch(client):
    assert "fine-tune" in assert_error(upload(client, purpose="fine-tune"), 400, "purpose")["message"]
    assert_error(upload(client, purpose="batch_output"), 400, "purpose")
    assert_error(upload(client, purpose=None), 400, "purpose")


def test_upload_needs_a_file_part(client):
    assert_error(client.post("/v1/files", data={"purpose": "batch"}), 400, "file")
    assert_error(client.post("/v1/files", data={"purpose": "batch", "file": "not a file part"}), 400, "file")
    assert_error(client.post("/v1/files", json={"purpose": "batch"}), 400, "file")


def test_unknown_file_is_404(client):
    assert_error(client.get("/v1/files/file-nope"), 404, "id", "not_found")
    assert_error(client.get("/v1/files/file-nope/content"), 404, "id", "not_found")
    assert_error(client.delete("/v1/files/file-nope"), 404, "id", "not_found")


# ---- creating batches -----------------------------------------------------------------------

def test_create_batch_is_validating_and_queues_run_batch(client, broker):
    file_id = upload(client).get_json()["id"]
    assert broker.llen(QUEUE) == 0
    response = create_batch(client, file_id, metadata={"job": "nightly", "owner": "ml"})
    assert response.status_code == 200, response.get_json()
    batch = response.get_json()
    created = batch["created_at"]
    assert batch == {
        "id": batch["id"], "object": "batch", "endpoint": "/v1/completions", "errors": None,
        "input_file_id": file_id, "completion_window": "24h", "status": "validating",
        "output_file_id": None, "error_file_id": None,
        "created_at": created, "in_progress_at": None, "expires_at": created + 24 * 3600,
        "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
        "cancelling_at": None, "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": {"job": "nightly", "owner": "ml"},
    }
    assert batch["id"].startswith("batch_") and isinstance(created, int)
    assert client.get(f"/v1/batches/{batch['id']}").get_json() == batch

    # Celery's Redis transport pushes each message onto a list named after the queue.
    assert broker.llen(QUEUE) == 1
    message = json.loads(broker.lindex(QUEUE, 0))
    assert message["headers"]["task"] == "llmq.run_batch"
    args, kwargs, _embed = json.loads(base64.b64decode(message["body"]))
    assert args == [batch["id"]] and kwargs == {}


def test_create_batch_chat_endpoint_and_other_windows(client):
    file_id = upload(client).get_json()["id"]
    batch = create_batch(client, file_id, endpoint="/v1/chat/completions", completion_window="72h").get_json()
    assert batch["endpoint"] == "/v1/chat/completions"
    assert batch["completion_window"] == "72h"
    assert batch["expires_at"] - batch["created_at"] == 72 * 3600
    assert batch["metadata"] == {}


def test_create_batch_input_file_errors(client, app):
    assert_error(create_batch(client, "file-nope"), 404, "input_file_id", "not_found")
    assert_error(client.post("/v1/batches", json={"endpoint": "/v1/completions", "completion_window": "24h"}),
                 400, "input_file_id")
    assert_error(create_batch(client, 42), 400, "input_file_id")

    deleted = upload(client).get_json()["id"]
    client.delete(f"/v1/files/{deleted}")
    assert_error(create_batch(client, deleted), 404, "input_file_id", "not_found")

    with app.extensions["llmq"].db.session() as session:  # a batch's output file is no input
        output = File(filename="out.jsonl", purpose="batch_output", bytes=3, content=b"{}\n")
        session.add(output)
    assert "purpose" in assert_error(create_batch(client, output.id), 400, "input_file_id")["message"]


def test_create_batch_field_errors(client, broker):
    file_id = upload(client).get_json()["id"]
    for endpoint in ("/v1/embeddings", "v1/completions", None, 3):
        assert_error(create_batch(client, file_id, endpoint=endpoint), 400, "endpoint")
    for window in ("48 hours", "0h", "169h", "24", "24H", 24, None, "1d"):
        assert_error(create_batch(client, file_id, completion_window=window), 400, "completion_window")
    too_many = {f"k{i}": "v" for i in range(17)}
    for metadata in (too_many, {"n": 1}, {"ok": "v", "flag": True}, {"k": None}, ["k", "v"], "k=v",
                     {"k": "v" * 513}, {"k" * 65: "v"}):
        assert_error(create_batch(client, file_id, metadata=metadata), 400, "metadata")
    assert create_batch(client, file_id, metadata={f"k{i}": "v" for i in range(16)}).status_code == 200
    assert_error(client.post("/v1/batches", data="not json", content_type="application/json"), 400, None)
    assert broker.llen(QUEUE) == 1  # only the one good batch was queued


# ---- reading batches ------------------------------------------------------------------------

def test_list_batches_newest_first_with_after_and_limit(client):
    first, second, third = (new_batch(client)["id"] for _ in range(3))

    page = client.get("/v1/batches?limit=2").get_json()
    assert [b["id"] for b in page["data"]] == [third, second]
    assert (page["object"], page["first_id"], page["last_id"], page["has_more"]) == ("list", third, second, True)

    rest = client.get(f"/v1/batches?after={page['last_id']}&limit=2").get_json()
    assert [b["id"] for b in rest["data"]] == [first]
    assert (rest["first_id"], rest["last_id"], rest["has_more"]) == (first, first, False)

    end = client.get(f"/v1/batches?after={first}").get_json()
    assert end == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}
    everything = client.get("/v1/batches").get_json()
    assert [b["id"] for b in everything["data"]] == [third, second, first] and not everything["has_more"]
    assert everything["data"][0] == client.get(f"/v1/batches/{third}").get_json()

    for limit in ("0", "101", "ten", "-1"):
        assert_error(client.get(f"/v1/batches?limit={limit}"), 400, "limit")
    assert_error(client.get("/v1/batches?after=batch_nope"), 400, "after")


def test_unknown_batch_is_404(client):
    assert_error(client.get("/v1/batches/batch_nope"), 404, "id", "not_found")
    assert_error(client.post("/v1/batches/batch_nope/cancel"), 404, "id", "not_found")


# ---- the bookkeeping a worker drives, and cancelling ------------------------------------------

MIXED_INPUT = "\n".join([
    line("a"),                 # 1
    line("b"),                 # 2
    '{"custom_id": "broken",',  # 3: not JSON
    "",                        # 4: blank lines are skipped but still counted
    line("c"),                 # 5
    line("a", "again"),        # 6: duplicate custom_id
]).encode() + b"\n"


def expand(app, batch_id: str) -> list[int]:
    """What the worker's llmq.run_batch task does first, without a worker."""
    with app.extensions["llmq"].db.session() as session:
        return batch_lifecycle.expand_input(session, session.get(Batch, batch_id), app.extensions["llmq"].model, app.extensions["llmq"].tokenizer, max_lines=100)


def items(app, batch_id: str) -> list[BatchItem]:
    with app.extensions["llmq"].db.session() as session:
        return list(session.scalars(select(BatchItem).where(BatchItem.batch_id == batch_id)
                                    .order_by(BatchItem.line)))


def test_expand_input_turns_bad_lines_into_numbered_error_lines(client, app):
    batch_id = new_batch(client, MIXED_INPUT)["id"]
    runnable = expand(app, batch_id)

    rows = items(app, batch_id)
    assert [(i.line, i.custom_id, i.status) for i in rows] == [
        (1, "a", "pending"), (2, "b", "pending"), (3, None, "failed"), (5, "c", "pending"), (6, "a", "failed")]
    assert sorted(runnable) == sorted(i.id for i in rows if i.status == "pending")
    errors = {i.line: json.loads(i.result) for i in rows if i.status == "failed"}
    assert errors[3]["error"]["line"] == 3 and errors[3]["error"]["code"] == "invalid_json"
    assert errors[3]["custom_id"] is None and errors[3]["response"] is None
    assert errors[6]["error"]["line"] == 6 and errors[6]["error"]["code"] == "duplicate_custom_id"
    assert errors[6]["custom_id"] == "a"

    batch = client.get(f"/v1/batches/{batch_id}").get_json()
    assert batch["status"] == "in_progress" and isinstance(batch["in_progress_at"], int)
    assert batch["request_counts"] == {"total": 5, "completed": 0, "failed": 2}

    # Cancelling before any line ran: the queued lines are cancelled at once and the batch ends, with
    # the bad lines in its error file.
    cancelled = client.post(f"/v1/batches/{batch_id}/cancel").get_json()
    assert cancelled["status"] == "cancelled"
    assert isinstance(cancelled["cancelling_at"], int) and isinstance(cancelled["cancelled_at"], int)
    assert cancelled["output_file_id"] is None
    assert cancelled["request_counts"] == {"total": 5, "completed": 0, "failed": 2}
    assert [i.status for i in items(app, batch_id)] == ["cancelled", "cancelled", "failed", "cancelled", "failed"]
    error_file = client.get(f"/v1/files/{cancelled['error_file_id']}").get_json()
    assert error_file["purpose"] == "batch_output"
    content = client.get(f"/v1/files/{cancelled['error_file_id']}/content").data.decode()
    assert [json.loads(x)["error"]["line"] for x in content.splitlines()] == [3, 6]


def test_cancel_validating_batch_with_no_items_is_cancelled_at_once(client):
    batch = new_batch(client)
    cancelled = client.post(f"/v1/batches/{batch['id']}/cancel")
    assert cancelled.status_code == 200
    body = cancelled.get_json()
    assert body["status"] == "cancelled"
    assert body["cancelling_at"] is not None and body["cancelled_at"] is not None
    assert body["output_file_id"] is None and body["error_file_id"] is None
    assert body["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    again = client.post(f"/v1/batches/{batch['id']}/cancel")  # idempotent
    assert again.status_code == 200 and again.get_json() == body


def test_cancel_flags_running_lines_and_the_last_one_ends_the_batch(client, app, broker):
    batch_id = new_batch(client)["id"]
    first, *others = sorted(expand(app, batch_id))
    with app.extensions["llmq"].db.session() as session:  # a worker has started the first line
        assert batch_lifecycle.claim_item(session, first, "cmpl-running1") is not None

    body = client.post(f"/v1/batches/{batch_id}/cancel").get_json()
    assert body["status"] == "cancelling" and body["cancelled_at"] is None
    assert broker.get(cancel_key("cmpl-running1")) == b"1"  # the worker aborts it at its next step
    assert [i.status for i in items(app, batch_id)] == ["running", "cancelled", "cancelled"]
    assert client.post(f"/v1/batches/{batch_id}/cancel").get_json()["status"] == "cancelling"

    with app.extensions["llmq"].db.session() as session:  # the worker's task sees its line aborted
        batch_lifecycle.record_result(session, first, "cancelled", None)
    with app.extensions["llmq"].db.session() as session:
        assert batch_lifecycle.finalize_if_done(session, batch_id) == "cancelled"
    assert client.get(f"/v1/batches/{batch_id}").get_json()["status"] == "cancelled"


def test_finished_batch_cannot_be_cancelled(client, app):
    batch_id = new_batch(client)["id"]
    with app.extensions["llmq"].db.session() as session:
        session.get(Batch, batch_id).status = "completed"
    error = assert_error(client.post(f"/v1/batches/{batch_id}/cancel"), 400, None, "invalid_batch_status")
    assert "completed" in error["message"]
    assert client.get(f"/v1/batches/{batch_id}").get_json()["status"] == "completed"


# ---- the official client reads these objects ------------------------------------------------

def test_openai_client_round_trip(app):
    openai = pytest.importorskip("openai")
    import httpx2

    client = openai.OpenAI(api_key="unused", base_url="http://llmq.test/v1", max_retries=0,
                           http_client=httpx2.Client(transport=httpx2.WSGITransport(app=app)),
                           _strict_response_validation=True)
    file = client.files.create(file=("in.jsonl", GOOD_INPUT), purpose="batch")
    assert client.files.retrieve(file.id).bytes == len(GOOD_INPUT)
    assert [f.id for f in client.files.list()] == [file.id]
    assert client.files.content(file.id).read() == GOOD_INPUT

    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h",
                                  metadata={"job": "x"})
    assert batch.status == "validating" and batch.metadata == {"job": "x"}
    assert client.batches.retrieve(batch.id).id == batch.id
    assert [b.id for b in client.batches.list(limit=5)] == [batch.id]
    assert client.batches.cancel(batch.id).status == "cancelled"
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    assert client.files.delete(file.id).deleted is True
