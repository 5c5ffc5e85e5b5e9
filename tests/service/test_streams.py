"""Token streams through Redis and SSE: joined tokens equal the stored text, Last-Event-ID resumes
without repeats, and a cancelled or disconnected stream frees its KV blocks."""
import json
import time

from tests.service.conftest import MODEL_NAME, wait_until, worker_blocks


def sse_events(response, limit=None):
    """Parse a text/event-stream response into dicts {id, event, data}; stop after `limit` events."""
    event, count = {}, 0
    for line in response.iter_lines():
        if line == "":
            if "data" in event:
                yield event
                count += 1
                if limit is not None and count >= limit:
                    return
            event = {}
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(":")
            event[field] = value[1:] if value.startswith(" ") else value


def submit(api, **body):
    response = api.post("/v1/requests", json={"model": MODEL_NAME, **body})
    assert response.status_code == 202, response.text
    return response.json()["id"]


def test_sse_tokens_equal_the_stored_text_and_resume_without_repeats(api):
    request_id = submit(api, prompt="Once upon a time", max_tokens=60, temperature=0, ignore_eos=True)
    with api.stream("GET", f"/v1/requests/{request_id}/events") as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        first = list(sse_events(response, limit=5))
    last_id = first[-1]["id"]
    with api.stream("GET", f"/v1/requests/{request_id}/events", headers={"Last-Event-ID": last_id}) as response:
        rest = list(sse_events(response))
    ids = [e["id"] for e in first + rest]
    assert len(ids) == len(set(ids)), "an event came twice"
    events = [json.loads(e["data"]) for e in first + rest]
    assert events[-1]["type"] == "done"
    streamed = "".join(e["text"] for e in events if e["type"] == "delta")
    assert sum(len(e["token_ids"]) for e in events if e["type"] == "delta") == 60

    final = wait_until(lambda: (r := api.get(f"/v1/requests/{request_id}").json())["status"] == "completed" and r)
    assert final["response"]["choices"][0]["text"] == streamed == final["text"]
    assert final["usage"]["completion_tokens"] == 60
    assert final["created_at"] <= final["started_at"] <= final["first_token_at"] <= final["finished_at"]


def test_streaming_completion_chunks_join_to_the_plain_completion(api):
    body = {"model": MODEL_NAME, "prompt": "The little dog", "max_tokens": 30, "temperature": 0}
    plain = api.post("/v1/completions", json=body).json()
    with api.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                      "stream_options": {"include_usage": True}}) as response:
        datas = [e["data"] for e in sse_events(response)]
    assert datas[-1] == "[DONE]"
    chunks = [json.loads(d) for d in datas[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == plain["choices"][0]["text"]
    assert chunks[-1]["usage"] == plain["usage"]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish == [plain["choices"][0]["finish_reason"]]


def test_client_disconnect_cancels_and_frees_every_block(api):
    _, total = worker_blocks(api)
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 480, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with api.stream("POST", "/v1/completions", json=body) as response:
        got = list(sse_events(response, limit=3))
    request_id = json.loads(got[0]["data"])["id"]
    # The connection is closed: the server notices at its next write and cancels the request.
    final = wait_until(lambda: (r := api.get(f"/v1/requests/{request_id}").json())["status"] == "cancelled" and r,
                       timeout=60)
    assert final["usage"] is None or final["usage"]["completion_tokens"] < 480
    wait_until(lambda: worker_blocks(api) == (total, total), timeout=30)


def test_explicit_cancel_frees_every_block(api):
    _, total = worker_blocks(api)
    request_id = submit(api, prompt="Once upon a time", max_tokens=480, temperature=0, ignore_eos=True)
    # Polled often: on a fast machine the 480 tokens take a fraction of a second.
    wait_until(lambda: api.get(f"/v1/requests/{request_id}").json()["status"] == "running", interval=0.005)
    cancelled = api.post(f"/v1/requests/{request_id}/cancel")
    assert cancelled.status_code == 200
    wait_until(lambda: api.get(f"/v1/requests/{request_id}").json()["status"] == "cancelled", timeout=60)
    wait_until(lambda: worker_blocks(api) == (total, total), timeout=30)
    state = api.get(f"/v1/requests/{request_id}").json()
    assert state["usage"] is None or state["usage"]["completion_tokens"] < 480


def idle_worker_totals(api, fresher_than: float) -> dict:
    """The worker's heartbeat once it is sent after `fresher_than` with nothing running or waiting."""
    def idle_beat():
        workers = [w for w in api.get("/v1/workers").json()["data"] if w["at"] > fresher_than]
        return workers and not workers[0]["running"] and not workers[0]["waiting"] and workers[0]
    return wait_until(idle_beat)


def test_the_workers_heartbeat_counts_the_engine_steps_and_tokens(api):
    before = idle_worker_totals(api, time.time())
    reply = api.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 25,
                                              "temperature": 0, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    after = idle_worker_totals(api, time.time())
    assert after["tokens"] - before["tokens"] == 25
    assert after["steps"] - before["steps"] >= 25  # one token per running sequence per step
    assert after["busy_seconds"] > before["busy_seconds"]
    assert after["async_scheduling"] is True  # LLMQ_ASYNC_SCHEDULING=1 (tests/service/conftest.py)
