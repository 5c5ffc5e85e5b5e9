"""Idempotency-Key on POST: a retried submission gets the first answer and never makes a second job.

Real Redis, a real migrated SQLite database, the real app. Where an answer needs a worker, the
stand-in for `enqueue` (tests/api/conftest.py) writes the events a worker would into the request's
Redis stream; elsewhere the real enqueue puts tasks on the real broker queue, which is counted.
"""
from __future__ import annotations

import io
import json
import threading
import time

import pytest
import redis

from llmq.events import DeltaEvent, DoneEvent, Event, Usage
from llmq.store.models import Batch, File, Request

MODEL = "stories260k"
QUEUE = f"llmq.{MODEL}"
BODY = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4}


@pytest.fixture
def broker(redis_url):
    return redis.Redis.from_url(redis_url)


def rows(app, model) -> list:
    with app.extensions["llmq"].db.session() as session:
        return session.query(model).all()


def idem(key: str, **headers) -> dict:
    return {"Idempotency-Key": key, **headers}


def events(text: str = " there was") -> list[Event]:
    return [DeltaEvent(0, text, (5, 6), finish_reason="stop", t=time.time()), DoneEvent(Usage(4, 2), time.time())]


def test_a_retried_request_submission_answers_the_first_and_queues_one_task(app, client, broker):
    first = client.post("/v1/requests", json=BODY, headers=idem("k-1"))
    assert first.status_code == 202 and "Idempotent-Replayed" not in first.headers
    # The same body with its keys in another order and other spacing is the same request.
    reordered = json.dumps(dict(reversed(list(BODY.items()))), indent=2)
    retry = client.post("/v1/requests", data=reordered, content_type="application/json", headers=idem("k-1"))
    assert retry.status_code == 202
    assert retry.get_json() == first.get_json()
    assert retry.headers["Location"] == first.headers["Location"]
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert [row.id for row in rows(app, Request)] == [first.get_json()["id"]]
    assert broker.llen(QUEUE) == 1

    other = client.post("/v1/requests", json=BODY, headers=idem("k-2"))
    assert other.status_code == 202 and other.get_json()["id"] != first.get_json()["id"]
    assert client.post("/v1/requests", json=BODY).get_json()["id"] not in (first.get_json()["id"], other.get_json()["id"])
    assert len(rows(app, Request)) == 3 and broker.llen(QUEUE) == 3


def test_the_same_key_with_another_request_is_422(app, client, worker):
    worker.events = events()  # were the key ignored, the completion below would get an answer, not hang
    assert client.post("/v1/requests", json=BODY, headers=idem("k")).status_code == 202
    for response in (client.post("/v1/requests", json={**BODY, "max_tokens": 5}, headers=idem("k")),
                     client.post("/v1/completions", json=BODY, headers=idem("k"))):
        assert response.status_code == 422, response.get_data(as_text=True)
        error = response.get_json()["error"]
        assert (error["code"], error["type"], error["param"]) == ("idempotency_key_reused", "invalid_request_error", None)
        assert "'k'" in error["message"] and "different" in error["message"]
    assert len(rows(app, Request)) == 1 and len(worker.ids) == 1


def test_keys_are_per_tenant(app, client, broker, new_key):
    _, acme = new_key(app, "acme")
    _, globex = new_key(app, "globex")
    one = client.post("/v1/requests", json=BODY, headers={**acme, **idem("shared")})
    two = client.post("/v1/requests", json=BODY, headers={**globex, **idem("shared")})
    assert (one.status_code, two.status_code) == (202, 202) and "Idempotent-Replayed" not in two.headers
    assert one.get_json()["id"] != two.get_json()["id"] and broker.llen(QUEUE) == 2


def test_a_refused_first_attempt_is_not_remembered(app, client):
    refused = client.post("/v1/requests", json={**BODY, "model": "other"}, headers=idem("k"))
    assert refused.status_code == 404
    accepted = client.post("/v1/requests", json=BODY, headers=idem("k"))  # a new body under the same key: runs
    assert accepted.status_code == 202 and "Idempotent-Replayed" not in accepted.headers
    assert client.post("/v1/requests", json=BODY, headers=idem("k")).get_json() == accepted.get_json()


def test_a_retried_upload_and_batch_make_one_of_each(app, client, broker):
    content = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}\n'

    def upload():  # every call builds its multipart body with a new random boundary
        return client.post("/v1/files", headers=idem("upload-1"),
                           data={"purpose": "batch", "file": (io.BytesIO(content), "in.jsonl")})

    first, retry = upload(), upload()
    assert first.status_code == retry.status_code == 200
    assert retry.get_json() == first.get_json() and retry.headers["Idempotent-Replayed"] == "true"
    assert len(rows(app, File)) == 1

    other_content = client.post("/v1/files", headers=idem("upload-1"),
                                data={"purpose": "batch", "file": (io.BytesIO(content + content), "in.jsonl")})
    assert other_content.status_code == 422

    batch_body = {"input_file_id": first.get_json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
    batches = [client.post("/v1/batches", json=batch_body, headers=idem("batch-1")) for _ in range(2)]
    assert batches[0].get_json() == batches[1].get_json() and batches[1].headers["Idempotent-Replayed"] == "true"
    assert len(rows(app, Batch)) == 1 and broker.llen(QUEUE) == 1


def test_a_duplicate_while_the_first_is_still_being_submitted_is_409(app, client, worker):
    worker.hold = threading.Event()
    first = {}
    thread = threading.Thread(target=lambda: first.update(
        response=app.test_client().post("/v1/requests", json=BODY, headers=idem("slow"))))
    thread.start()
    deadline = time.time() + 10
    while not worker.ids and time.time() < deadline:  # the first attempt is inside enqueue now
        time.sleep(0.01)
    duplicate = client.post("/v1/requests", json=BODY, headers=idem("slow"))
    worker.hold.set()
    thread.join(10)
    assert duplicate.status_code == 409, duplicate.get_data(as_text=True)
    assert duplicate.get_json()["error"]["code"] == "idempotency_request_in_progress"
    assert duplicate.headers["Retry-After"] == "1"
    assert first["response"].status_code == 202
    replay = client.post("/v1/requests", json=BODY, headers=idem("slow"))
    assert replay.get_json() == first["response"].get_json() and len(worker.ids) == 1


def data_lines(response) -> list[str]:
    return [line for line in response.get_data(as_text=True).splitlines() if line.startswith("data: ")]


def test_a_retried_stream_replays_the_first_streams_events(app, client, worker):
    worker.events = events()
    body = {**BODY, "stream": True}
    first = client.post("/v1/completions", json=body, headers=idem("s-1"))
    assert first.status_code == 200 and first.mimetype == "text/event-stream"
    first_lines = data_lines(first)
    assert first_lines[-1] == "data: [DONE]" and any(" there was" in line for line in first_lines)

    retry = client.post("/v1/completions", json=body, headers=idem("s-1"))
    assert retry.status_code == 200 and retry.mimetype == "text/event-stream"
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert data_lines(retry) == first_lines  # the same id, created time, text and end
    assert len(worker.ids) == 1 and [row.id for row in rows(app, Request)] == worker.ids


def test_a_duplicate_of_a_waiting_completion_waits_for_the_same_request(app, client, worker):
    worker.events = events(" and then")
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(
        app.test_client().post("/v1/completions", json=BODY, headers=idem("w-1")))) for _ in range(2)]
    threads[0].start()
    time.sleep(0.3)  # the first attempt has made its request and waits for its events
    threads[1].start()
    for thread in threads:
        thread.join(15)
    assert [answer.status_code for answer in answers] == [200, 200]
    assert answers[0].get_json() == answers[1].get_json()
    assert answers[0].get_json()["choices"][0]["text"] == " and then"
    assert sorted(answer.headers.get("Idempotent-Replayed", "") for answer in answers) == ["", "true"]
    assert len(worker.ids) == 1 and len(rows(app, Request)) == 1
    replay = client.post("/v1/completions", json=BODY, headers=idem("w-1"))
    assert replay.get_json() == answers[0].get_json() and len(worker.ids) == 1


def test_a_bad_idempotency_key_is_400(client):
    response = client.post("/v1/requests", json=BODY, headers=idem("x" * 256))
    assert response.status_code == 400 and response.get_json()["error"]["code"] == "invalid_idempotency_key"


def test_an_upload_with_a_part_whose_name_cannot_be_read_is_answered_not_a_500(client):
    # A newline inside a part's name breaks its header: werkzeug names such a part None (found by the fuzzer).
    body = (b'--b\r\nContent-Disposition: form-data; name="a\nb"\r\n\r\nnull\r\n'
            b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--b--\r\n')
    response = client.post("/v1/files", data=body, content_type="multipart/form-data; boundary=b",
                           headers=idem("odd-part"))
    assert response.status_code == 400, response.get_data(as_text=True)
    assert response.get_json()["error"]["param"] == "file"
