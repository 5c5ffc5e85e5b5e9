"""Completions, chat completions and the requests resource, with no worker: the web process against
a real Redis server and a migrated SQLite database.

Bad input must answer the OpenAI error shape naming the field. Where an answer needs a worker, a
stand-in takes its place (tests/api/conftest.py): `enqueue` is replaced by one that writes the
events a worker would (llmq/events.py's contract) into the request's stream, so the assembly of
answers, stream chunks, resume and cancel are checked exactly.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from app import create_app
from app.api import common
from llmq import events
from llmq.events import DoneEvent, ErrorEvent, Usage, cancel_key, stream_key
from llmq.settings import Settings
from llmq.store.models import Request
from tests.api.conftest import StandInWorker

REPO = Path(__file__).resolve().parents[2]
MODEL = "stories260k"


# ---- fixtures -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory, stories_dir) -> Path:
    """stories260k with a chat template, so the chat endpoint has something to render."""
    folder = tmp_path_factory.mktemp("chat-model") / "stories-chat"
    shutil.copytree(stories_dir, folder)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")
    return folder


def make_app(tmp_path, migrated_db, redis_url, model_dir, model_name):
    db_path = tmp_path / "t.db"
    shutil.copy(migrated_db, db_path)
    redis.Redis.from_url(redis_url).flushdb()
    settings = Settings(home=tmp_path, database_url=f"sqlite:///{db_path}", redis_url=redis_url,
                        model_path=str(model_dir), model_name=model_name)
    flask_app = create_app(settings)
    flask_app.config["TESTING"] = True
    return flask_app


@pytest.fixture
def app(tmp_path, migrated_db, redis_url, stories_dir):
    flask_app = make_app(tmp_path, migrated_db, redis_url, stories_dir, MODEL)
    yield flask_app
    flask_app.extensions["llmq"].db.engine.dispose()


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture
def r(redis_url):
    return redis.Redis.from_url(redis_url)


def delta(index, text, finish_reason=None, token_ids=(), logprobs=None):
    """A delta event as its JSON says it (logprobs as [{"token_id", "logprob", "top"}]), through the codec."""
    return events.from_dict({"type": "delta", "index": index, "text": text, "token_ids": list(token_ids),
                             "logprobs": logprobs, "finish_reason": finish_reason, "t": time.time()})


def done(prompt_tokens=3, completion_tokens=2):
    return DoneEvent(Usage(prompt_tokens, completion_tokens), time.time())


def assert_error(resp, status, param=None, code=None, error_type="invalid_request_error"):
    assert resp.status_code == status, resp.get_data(as_text=True)
    body = resp.get_json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == error_type and body["error"]["message"]
    assert body["error"]["param"] == param
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


def sse_data(text: str) -> list:
    """The data payloads of an SSE body, comments skipped."""
    return [json.loads(line[6:]) if line[6:] != "[DONE]" else "[DONE]"
            for line in text.splitlines() if line.startswith("data: ")]


# ---- bad input ------------------------------------------------------------------------------

def test_malformed_json_and_non_object_bodies(client, worker):
    resp = client.post("/v1/completions", data="{not json", content_type="application/json")
    assert_error(resp, 400, code="invalid_json")
    assert_error(client.post("/v1/completions", json=[1, 2]), 400, code="invalid_json")
    assert_error(client.post("/v1/chat/completions", json="hello"), 400, code="invalid_json")
    assert worker.ids == []


@pytest.mark.parametrize("data", ['{"prompt": "x", "temperature": Infinity}', '{"prompt": "x", "top_p": NaN}',
                                  '{"prompt": "x", "temperature": 1e309}',
                                  '{"prompt": ' + "[" * 50_000 + "]" * 50_000 + "}"])
def test_numbers_json_does_not_allow_and_nesting_too_deep_are_invalid_json(client, worker, data):
    assert_error(client.post("/v1/completions", data=data, content_type="application/json"), 400, code="invalid_json")
    assert worker.ids == []


def test_a_lone_surrogate_in_a_prompt_is_a_400_naming_it(client, worker):
    data = '{"model": "%s", "prompt": "Once \\ud800 upon"}' % MODEL
    assert_error(client.post("/v1/completions", data=data, content_type="application/json"), 400, param="prompt")
    assert worker.ids == []


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": "x"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"n": 0}, "n"),
    ({"stop": 5}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"top_p": 2}, "top_p"),
    ({"logprobs": True}, "logprobs"),
    ({"echo": "yes"}, "echo"),
    ({"stream": 1}, "stream"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], 3]}, "prompt"),
    ({"prompt": [1, 99999]}, "prompt"),  # a token id outside the vocabulary
    ({"max_tokens": 1000}, "max_tokens"),  # prompt + max_tokens beyond the 512-token context
    ({"prompt": "hi " * 600}, "prompt"),  # the prompt alone fills the context
    ({"n": 129}, "n"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
])
def test_bad_completion_fields_name_the_param(client, worker, fields, param):
    body = {"model": MODEL, "prompt": "Once upon a time", **fields}
    assert_error(client.post("/v1/completions", json=body), 400, param=param, code="invalid_request")
    assert worker.ids == []


def test_missing_prompt_and_model(client, worker):
    assert_error(client.post("/v1/completions", json={"model": MODEL}), 400, param="prompt")
    assert_error(client.post("/v1/completions", json={"prompt": "hi"}), 400, param="model", code="missing_model")


def test_unknown_model_is_404(client, worker):
    err = assert_error(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404,
                       param="model", code="model_not_found")
    assert "gpt-9" in err["message"] and MODEL in err["message"]
    assert_error(client.post("/v1/chat/completions", json={"model": "gpt-9", "messages": []}), 404,
                 param="model", code="model_not_found")
    assert_error(client.get("/v1/models/gpt-9"), 404, param="model", code="model_not_found")


def test_chat_bad_messages(client, worker):
    assert_error(client.post("/v1/chat/completions", json={"model": MODEL}), 400, param="messages")
    assert_error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": []}), 400, param="messages")
    assert_error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": ["hi"]}), 400,
                 param="messages[0]")
    assert worker.ids == []


def test_chat_needs_a_chat_template(client, worker):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    err = assert_error(client.post("/v1/chat/completions", json=body), 400, param="model", code="no_chat_template")
    assert f"model {MODEL} has no chat template" in err["message"]
    assert worker.ids == []


def test_unknown_request_ids_are_404(client):
    for resp in (client.get("/v1/requests/cmpl-nope"), client.get("/v1/requests/cmpl-nope/events"),
                 client.post("/v1/requests/cmpl-nope/cancel")):
        err = assert_error(resp, 404, param="id", code="not_found")
        assert "cmpl-nope" in err["message"]


def test_last_event_id_past_redis_range_is_a_400(client, worker):
    # Found checking the OpenAPI description's bounds: Redis refused the id, and the client got a 500.
    request_id = client.post("/v1/requests", json={"model": MODEL, "prompt": "hi"}).get_json()["id"]
    for last_id in ("18446744073709551616", "1-18446744073709551616", "99999999999999999999999-0"):
        err = assert_error(client.get(f"/v1/requests/{request_id}/events", headers={"Last-Event-ID": last_id}), 400,
                           param="last_event_id", code="invalid_request")
        assert last_id in err["message"]


def test_a_last_event_id_too_long_to_parse_is_a_400_quoting_only_its_start(client, worker):
    request_id = client.post("/v1/requests", json={"model": MODEL, "prompt": "hi"}).get_json()["id"]
    last_id = "7" * 5000  # past what int() converts: that was a 500
    err = assert_error(client.get(f"/v1/requests/{request_id}/events", headers={"Last-Event-ID": last_id}), 400,
                       param="last_event_id", code="invalid_request")
    assert "(5000 characters)" in err["message"] and len(err["message"]) < 300


def test_a_model_that_is_not_a_string_is_a_400_and_a_long_one_is_quoted_short(client, worker):
    err = assert_error(client.post("/v1/completions", json={"model": 7, "prompt": "hi"}), 400, param="model",
                       code="invalid_request")
    assert "model must be a string" in err["message"]
    long_name = "m" * 100_000
    err = assert_error(client.post("/v1/completions", json={"model": long_name, "prompt": "hi"}), 404,
                       param="model", code="model_not_found")
    assert "(100000 characters)" in err["message"] and len(err["message"]) < 300
    assert worker.ids == []


def test_requests_refuses_prompt_and_messages_together(client, worker):
    body = {"model": MODEL, "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    assert_error(client.post("/v1/requests", json=body), 400, param="messages")
    assert_error(client.post("/v1/requests", json={"model": MODEL}), 400, param="prompt")


def test_unknown_route_and_method(client):
    assert_error(client.get("/v1/nothing-here"), 404)
    assert_error(client.get("/v1/completions"), 405)


def test_models_list(client):
    assert client.get("/v1/models").get_json() == {
        "object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "llmq"}]}


def test_web_modules_do_not_import_torch():
    code = ("import sys, app, app.api.completions, app.api.requests, llmq.protocol.responses, llmq.protocol.prepare; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# ---- answers assembled from the stream (a fake worker writes the events) ------------------------

def test_completion_waits_and_assembles_choices(client, worker, app):
    worker.events = [delta(1, "Tom", token_ids=[5]), delta(0, " was", token_ids=[6]),
                     delta(0, " happy", "stop", [7]), delta(1, " ran", "length", [8]), done(4, 4)]
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "n": 2})
    assert resp.status_code == 200, resp.get_json()
    body = resp.get_json()
    assert body["id"] == worker.ids[0] and body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion" and body["model"] == MODEL and isinstance(body["created"], int)
    assert body["choices"] == [
        {"index": 0, "text": " was happy", "logprobs": None, "finish_reason": "stop"},
        {"index": 1, "text": "Tom ran", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    with app.extensions["llmq"].db.session() as session:
        row = session.get(Request, body["id"])
        assert (row.kind, row.status, row.body["n"]) == ("completion", "queued", 2)


def test_completion_echo_and_logprobs(client, worker, app):
    with app.app_context():
        tokenizer = common.tokenizer()
    ids = tokenizer.encode(" happy", add_special_tokens=False)
    lps = [{"token_id": t, "logprob": -0.5, "top": [[t, -0.5]]} for t in ids]
    worker.events = [delta(0, " happy", "stop", ids, lps), done(3, len(ids))]
    body = client.post("/v1/completions", json={"model": MODEL, "prompt": "Tom was", "logprobs": 1,
                                                "echo": True}).get_json()
    choice = body["choices"][0]
    prompt_text = tokenizer.decode(tokenizer.encode("Tom was"))
    assert choice["text"] == prompt_text + " happy"
    assert choice["logprobs"]["token_logprobs"] == [-0.5] * len(ids)
    assert choice["logprobs"]["text_offset"][0] == len(prompt_text)
    assert "".join(choice["logprobs"]["tokens"]).strip() == "happy"


@pytest.mark.parametrize("code, status, error_type", [("invalid_request", 400, "invalid_request_error"),
                                                       ("server_error", 500, "server_error")])
def test_error_event_becomes_openai_error(client, worker, code, status, error_type):
    worker.events = [ErrorEvent(code, "it broke", t=time.time())]
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert assert_error(resp, status, code=code, error_type=error_type)["message"] == "it broke"


def test_completion_stream_chunks_usage_and_done(client, worker):
    worker.events = [delta(0, "Once"), delta(0, ""), delta(0, " upon", "stop"), done(2, 2)]
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True,
                                                "stream_options": {"include_usage": True}})
    assert resp.status_code == 200 and resp.mimetype == "text/event-stream"
    payloads = sse_data(resp.get_data(as_text=True))
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert {c["id"] for c in chunks} == {worker.ids[0]} and {c["object"] for c in chunks} == {"text_completion"}
    assert [c["choices"] for c in chunks[:2]] == [
        [{"index": 0, "text": "Once", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": " upon", "logprobs": None, "finish_reason": "stop"}]]
    assert chunks[2]["choices"] == [] and chunks[2]["usage"]["total_tokens"] == 4


def test_chat_stream_and_wait(tmp_path, migrated_db, redis_url, chat_model_dir, r, monkeypatch):
    chat_app = make_app(tmp_path, migrated_db, redis_url, chat_model_dir, "stories-chat")
    client, worker = chat_app.test_client(), StandInWorker(r)
    monkeypatch.setattr(common, "enqueue", worker)
    messages = [{"role": "user", "content": "Tell a story"}]
    worker.events = [delta(0, "Once"), delta(0, " more", "stop"), done()]
    body = client.post("/v1/chat/completions", json={"model": "stories-chat", "messages": messages}).get_json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Once more"},
                                "logprobs": None, "finish_reason": "stop"}]
    resp = client.post("/v1/chat/completions", json={"model": "stories-chat", "messages": messages, "stream": True})
    chunks = sse_data(resp.get_data(as_text=True))
    assert chunks[-1] == "[DONE]"
    assert {c["object"] for c in chunks[:-1]} == {"chat.completion.chunk"}
    assert [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks[:-1]] == [
        ({"role": "assistant", "content": ""}, None), ({"content": "Once"}, None), ({"content": " more"}, None),
        ({}, "stop")]
    chat_app.extensions["llmq"].db.engine.dispose()


def test_stream_client_leaving_cancels_the_request(client, worker, r):
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True}, buffered=False)
    chunks = iter(resp.response)
    assert next(chunks).decode() == ": keep-alive\n\n"  # nothing from the (absent) worker for a second
    assert not r.exists(cancel_key(worker.ids[0]))
    resp.close()
    assert r.exists(cancel_key(worker.ids[0]))


# ---- the requests resource ------------------------------------------------------------------

def test_request_lifecycle_poll_and_resume(client, worker, app, r):
    resp = client.post("/v1/requests", json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
    assert resp.status_code == 202
    request_id = resp.get_json()["id"]
    assert resp.headers["Location"].endswith(f"/v1/requests/{request_id}")
    assert resp.get_json()["status"] == "queued" and resp.get_json()["usage"] is None

    worker.publish(request_id, [delta(0, "Once"), delta(0, " upon")])
    polled = client.get(f"/v1/requests/{request_id}").get_json()
    assert polled["text"] == "Once upon" and polled["choices"] == [{"index": 0, "text": "Once upon",
                                                                    "finish_reason": None}]
    assert polled["usage"] is None and polled["response"] is None

    first_id = r.xrange(stream_key(request_id))[0][0].decode()
    worker.publish(request_id, [delta(0, " a", "length"), done(1, 3)])
    resumed = client.get(f"/v1/requests/{request_id}/events", headers={"Last-Event-ID": first_id})
    text = resumed.get_data(as_text=True)
    assert [line for line in text.splitlines() if line.startswith("event: ")] == [
        "event: delta", "event: delta", "event: done"]
    assert first_id not in text and '" upon"' in text
    assert client.get(f"/v1/requests/{request_id}/events?last_event_id=0-0").get_data(as_text=True).count("id: ") == 4
    last_id = r.xrevrange(stream_key(request_id), count=1)[0][0].decode()
    assert client.get(f"/v1/requests/{request_id}/events", headers={"Last-Event-ID": last_id}).status_code == 204
    assert_error(client.get(f"/v1/requests/{request_id}/events?last_event_id=abc"), 400, param="last_event_id")

    response = {"id": request_id, "object": "text_completion", "created": 1, "model": MODEL,
                "usage": done(1, 3).usage.as_dict(), "choices": [{"index": 0, "text": "Once upon a", "logprobs": None, "finish_reason": "length"}]}
    with app.extensions["llmq"].db.session() as session:  # what the task stores when it ends
        row = session.get(Request, request_id)
        row.status, row.response, row.finished_at = "completed", response, time.time()
    polled = client.get(f"/v1/requests/{request_id}").get_json()
    assert polled["status"] == "completed" and polled["response"] == response and polled["usage"]["total_tokens"] == 4


def test_cancel_a_queued_request(client, worker, r):
    request_id = client.post("/v1/requests", json={"model": MODEL, "prompt": "hi"}).get_json()["id"]
    cancelled = client.post(f"/v1/requests/{request_id}/cancel")
    assert cancelled.status_code == 200
    assert cancelled.get_json()["status"] == "cancelled" and cancelled.get_json()["finished_at"] is not None
    assert r.exists(cancel_key(request_id))
    events = client.get(f"/v1/requests/{request_id}/events").get_data(as_text=True)
    assert "event: error" in events and '"cancelled"' in events
    # A waiting /v1/completions caller of a request cancelled before it ran gets a clear answer too.
    worker.events = [ErrorEvent("cancelled", "cancelled", t=time.time())]
    assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}), 409, code="cancelled")


def test_events_client_leaving_cancels_only_when_asked_to(client, worker, r):
    for query, cancels in (("", False), ("?cancel_on_disconnect=true", True)):
        request_id = client.post("/v1/requests", json={"model": MODEL, "prompt": "hi"}).get_json()["id"]
        worker.publish(request_id, [delta(0, "Once")])
        resp = client.get(f"/v1/requests/{request_id}/events{query}", buffered=False)
        chunks = iter(resp.response)
        assert next(chunks).decode().startswith("id: ")
        resp.close()
        assert bool(r.exists(cancel_key(request_id))) is cancels


def test_stream_chunk_logprobs_continue_the_text_offsets():
    from llmq.protocol.responses import ChunkBuilder, ResponseSpec

    spec = ResponseSpec(id="cmpl-x", kind="completion", model=MODEL, created=1, num_choices=2, n=2, logprobs=True,
                        echo_prefixes=("Hi",))
    builder = ChunkBuilder(spec, token_text=lambda t: {1: " a", 2: "bc"}[t])
    lp = [{"token_id": 1, "logprob": -1.0, "top": [[2, -2.0]]}]
    first = builder.chunks(delta(1, " a", logprobs=lp))[0]["choices"][0]
    assert first["text"] == "Hi a" and first["logprobs"]["text_offset"] == [2]
    assert first["logprobs"]["top_logprobs"] == [{"bc": -2.0}]
    second = builder.chunks(delta(1, "bc", "stop", logprobs=[{"token_id": 2, "logprob": -0.1, "top": []}]))
    assert second[0]["choices"][0]["text"] == "bc" and second[0]["choices"][0]["logprobs"]["text_offset"] == [4]
    assert builder.chunks(delta(0, "")) == [{"id": "cmpl-x", "object": "text_completion", "created": 1, "model": MODEL,
                                             "choices": [{"index": 0, "text": "Hi", "logprobs": {
                                                 "tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                 "text_offset": []}, "finish_reason": None}]}]
