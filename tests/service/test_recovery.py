"""Crashes, preemption and restarts, with real processes: a worker killed with SIGKILL or stopped with
SIGTERM in the middle of a batch, Redis restarted, the web server restarted, a batch's completion
window passing. Each test starts its own stack (a private Redis, two Celery workers, gunicorn), so one
fault never leaks into another test.

What every batch test checks: the batch completes with every line exactly once, and the greedy
outputs equal the offline engine's for the same prompts, as if nothing had happened. Where a request
was interrupted, the worker that took it over says so in its log ("resuming ... from its
checkpoint"), and the request's token stream holds each token once.
"""
from __future__ import annotations

import json
import signal
import time

import httpx
import pytest
import redis
import sqlalchemy

from llmq.engine.llm import LLM
from llmq.sampling_params import SamplingParams
from llmq.streams import read_progress
from stack.local import LocalStack
from tests.service.conftest import MODEL_NAME, wait_until
from tests.service.test_streams import sse_events

PROMPTS = ["Once upon a time", "The little dog", "Lily wanted to", "One day, Tom", "The sun was", "Mom said",
           "A big red ball", "They went to the park", "The bird sang", "Ben had a toy", "She was very happy",
           "It was a cold day", "The cat saw a", "There was a tree", "He liked to run", "The girl found"]
MAX_TOKENS = 200  # long enough that a fault lands while lines are mid-generation
GRACE_S = 10

# Short timeouts so a fault is noticed in seconds: redelivery after 6 s unacknowledged, a dead worker's
# lease lapses 8 s after its last heartbeat (longer than the Redis restart below, so no live lease lapses).
FAULT_ENV = {"LLMQ_MAX_NUM_SEQS": "6", "LLMQ_HEARTBEAT_SECONDS": "1", "LLMQ_VISIBILITY_TIMEOUT": "6",
             "LLMQ_LEASE_SECONDS": "8", "LLMQ_SHUTDOWN_GRACE_SECONDS": str(GRACE_S), "LLMQ_SWEEP_SECONDS": "1",
             "LLMQ_REDIS_RETRY_SECONDS": "30"}


@pytest.fixture(scope="module")
def offline(served_model_dir) -> dict[str, str]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = LLM(str(served_model_dir), dtype="float32").generate(PROMPTS, params, use_tqdm=False)
    return {prompt: output.text for prompt, output in zip(PROMPTS, outputs)}


def fault_stack(served_model_dir, tmp_path, workers: int = 2, **env) -> LocalStack:
    home = tmp_path / "home"
    return LocalStack({"LLMQ_HOME": str(home), "DATABASE_URL": f"sqlite:///{home / 'llmq.db'}",
                       "MODEL_PATH": str(served_model_dir), "MODEL_NAME": MODEL_NAME, **FAULT_ENV, **env},
                      start_redis=True, workers=workers, log_dir=tmp_path, web="gunicorn")


def start_batch(api: httpx.Client, prompts=PROMPTS, window: str = "24h", max_tokens: int = MAX_TOKENS) -> str:
    lines = [json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": MODEL_NAME, "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                                  "ignore_eos": True}}) for i, p in enumerate(prompts)]
    upload = api.post("/v1/files", files={"file": ("in.jsonl", "\n".join(lines).encode())}, data={"purpose": "batch"})
    assert upload.status_code == 200, upload.text
    created = api.post("/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint": "/v1/completions",
                                           "completion_window": window})
    assert created.status_code == 200, created.text
    return created.json()["id"]


def wait_for_end(api: httpx.Client, batch_id: str, timeout: float = 240) -> dict:
    return wait_until(lambda: (b := api.get(f"/v1/batches/{batch_id}").json())["status"] in
                      ("completed", "failed", "cancelled", "expired") and b, timeout=timeout)


def file_lines(api: httpx.Client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in api.get(f"/v1/files/{file_id}/content").text.splitlines()]


def assert_every_line_once_and_equal_to_offline(api: httpx.Client, batch: dict, offline: dict,
                                                prompts: list[str] = PROMPTS, max_tokens: int = MAX_TOKENS) -> list[dict]:
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": len(prompts), "completed": len(prompts), "failed": 0}
    rows = file_lines(api, batch["output_file_id"])
    custom_ids = [row["custom_id"] for row in rows]
    assert sorted(custom_ids) == sorted(f"line-{i}" for i in range(len(prompts))), "a line is missing or twice"
    for row in rows:
        prompt = prompts[int(row["custom_id"].split("-")[1])]
        body = row["response"]["body"]
        assert body["choices"][0]["text"] == offline[prompt], f"{row['custom_id']} differs from the offline run"
        assert body["usage"]["completion_tokens"] == max_tokens
    return rows


def assert_streams_hold_each_token_once(stack: LocalStack, rows: list[dict]) -> None:
    """A resumed request appends to the same stream: its deltas join to exactly the final tokens."""
    client = redis.Redis.from_url(stack.redis_url)
    for row in rows:
        progress = read_progress(client, row["response"]["body"]["id"])
        assert progress.num_tokens == MAX_TOKENS, row["custom_id"]
        assert progress.choices[0].text == row["response"]["body"]["choices"][0]["text"]


def assert_batch_came_through(api: httpx.Client, stack: LocalStack, batch_id: str, offline: dict,
                              prompts: list[str] = PROMPTS, timeout: float = 240) -> None:
    """The batch ends completed, every line once, as the offline engine writes it, no token twice."""
    rows = assert_every_line_once_and_equal_to_offline(api, wait_for_end(api, batch_id, timeout), offline, prompts)
    assert_streams_hold_each_token_once(stack, rows)


def running_on(api: httpx.Client, worker: str) -> int:
    return sum(w["running"] for w in api.get("/v1/workers").json()["data"] if w["name"].startswith(worker + "@"))


def log_of(tmp_path, worker: str) -> str:
    return (tmp_path / f"worker-{worker}.log").read_text()


def test_a_worker_killed_mid_batch_loses_nothing(served_model_dir, tmp_path, offline):
    with fault_stack(served_model_dir, tmp_path) as stack, httpx.Client(base_url=stack.base_url, timeout=60) as api:
        batch_id = start_batch(api)
        wait_until(lambda: running_on(api, "w0") > 0 and api.get(f"/v1/batches/{batch_id}").json()
                   ["request_counts"]["completed"] < len(PROMPTS) // 2, timeout=120, interval=0.1)
        time.sleep(1.0)  # well into generation: its lines have streamed tokens
        assert stack.kill_worker("w0", signal.SIGKILL) == -signal.SIGKILL
        assert_batch_came_through(api, stack, batch_id, offline)
        assert "from its checkpoint" in log_of(tmp_path, "w1"), "no line was resumed from a checkpoint"


@pytest.mark.parametrize("engine_process", ["1", "0"], ids=["engine-process", "engine-in-worker"])
def test_a_worker_told_to_stop_hands_its_work_back_in_time(served_model_dir, tmp_path, offline, engine_process):
    with fault_stack(served_model_dir, tmp_path, LLMQ_ENGINE_PROCESS=engine_process) as stack, \
            httpx.Client(base_url=stack.base_url, timeout=60) as api:
        batch_id = start_batch(api)
        wait_until(lambda: running_on(api, "w0") > 0, timeout=120, interval=0.1)
        time.sleep(1.0)
        started = time.monotonic()
        exit_code = stack.kill_worker("w0", signal.SIGTERM, timeout=GRACE_S + 20)
        stopped_in = time.monotonic() - started
        assert exit_code == 0 and stopped_in < GRACE_S, f"exit code {exit_code} after {stopped_in:.1f} s"
        assert "handing its requests back" in log_of(tmp_path, "w0")
        assert ("engine process" in log_of(tmp_path, "w0")) == (engine_process == "1")
        assert_batch_came_through(api, stack, batch_id, offline)
        assert "from its checkpoint" in log_of(tmp_path, "w1"), "no handed-back line was resumed"


def test_redis_restarted_mid_batch_loses_nothing(served_model_dir, tmp_path, offline):
    with fault_stack(served_model_dir, tmp_path) as stack, httpx.Client(base_url=stack.base_url, timeout=60) as api:
        batch_id = start_batch(api)
        wait_until(lambda: api.get(f"/v1/batches/{batch_id}").json()["request_counts"]["completed"] >= 2,
                   timeout=120, interval=0.1)
        stack.restart_redis(down_s=2.0)
        assert_batch_came_through(api, stack, batch_id, offline)
        assert len(api.get("/v1/workers").json()["data"]) == 2, "a worker did not reconnect"


def test_redis_away_past_the_retry_window_fails_no_line(served_model_dir, tmp_path, offline):
    # The clients give up on Redis after 2 s; it stays down for 9 s (past the 8 s leases, which are
    # taken again when it is back). Lines whose tokens could not be written go on from their
    # checkpoints once it answers, and lines that could not start go back to the queue, instead of
    # ending as server_error.
    # Four times the prompts: after the first lines end, seconds of work are left for the outage to land in,
    # however fast the engine runs them.
    prompts = PROMPTS * 4
    with fault_stack(served_model_dir, tmp_path, workers=1, LLMQ_REDIS_RETRY_SECONDS="2") as stack, \
            httpx.Client(base_url=stack.base_url, timeout=60) as api:
        batch_id = start_batch(api, prompts)
        wait_until(lambda: api.get(f"/v1/batches/{batch_id}").json()["request_counts"]["completed"] >= 2,
                   timeout=120, interval=0.1)
        stack.restart_redis(down_s=9.0)
        assert_batch_came_through(api, stack, batch_id, offline, prompts)
        # Cut short mid-run (its tokens could not be written), or before it could start (its checkpoint
        # could not be read): either way the worker waited for Redis instead of failing the line.
        assert "Redis is back, so" in log_of(tmp_path, "w0")


def test_a_stream_resumes_across_a_web_restart(served_model_dir, tmp_path, offline):
    with fault_stack(served_model_dir, tmp_path, workers=1) as stack:
        with httpx.Client(base_url=stack.base_url, timeout=60) as api:
            response = api.post("/v1/requests", json={"model": MODEL_NAME, "prompt": PROMPTS[0],
                                                      "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
            assert response.status_code == 202, response.text
            request_id = response.json()["id"]
            with api.stream("GET", f"/v1/requests/{request_id}/events") as stream:
                before = list(sse_events(stream, limit=5))
        stack.restart_web()
        # The client reconnects after its server died: a new connection, resuming where it stopped.
        with httpx.Client(base_url=stack.base_url, timeout=60) as api:
            polled = api.get(f"/v1/requests/{request_id}")
            assert polled.status_code == 200 and polled.json()["id"] == request_id
            with api.stream("GET", f"/v1/requests/{request_id}/events",
                            headers={"Last-Event-ID": before[-1]["id"]}) as stream:
                after = list(sse_events(stream))
            ids = [e["id"] for e in before + after]
            assert len(ids) == len(set(ids)), "an event came twice"
            events = [json.loads(e["data"]) for e in before + after]
            assert events[-1]["type"] == "done"
            assert "".join(e["text"] for e in events if e["type"] == "delta") == offline[PROMPTS[0]]
            final = wait_until(lambda: (r := api.get(f"/v1/requests/{request_id}").json())["status"] == "completed"
                               and r)
            assert final["text"] == offline[PROMPTS[0]]


def test_a_batch_past_its_completion_window_is_expired_with_its_done_lines(served_model_dir, tmp_path, offline):
    prompts = PROMPTS * 3
    with fault_stack(served_model_dir, tmp_path, workers=1) as stack, \
            httpx.Client(base_url=stack.base_url, timeout=60) as api:
        batch_id = start_batch(api, prompts, window="1h")
        wait_until(lambda: api.get(f"/v1/batches/{batch_id}").json()["request_counts"]["completed"] >= 2,
                   timeout=120, interval=0.1)
        # The window ends now: moved in the database, so the test does not hang on the machine's speed.
        # The workers' sweep (every LLMQ_SWEEP_SECONDS) finds it; nothing else is touched.
        ends_at = time.time()
        engine = sqlalchemy.create_engine(stack.settings.database_url)
        with engine.begin() as connection:
            connection.execute(sqlalchemy.text("UPDATE batches SET expires_at = :t WHERE id = :id"),
                               {"t": ends_at, "id": batch_id})
        engine.dispose()
        batch = wait_until(lambda: (b := batch_after_sweep(stack, batch_id))["status"] == "expired" and b, timeout=30)
        assert batch["expired_at"] >= int(ends_at)
        done, expired = file_lines(api, batch["output_file_id"]), file_lines(api, batch["error_file_id"])
        assert len(done) >= 2 and expired, "the window should end with some lines done and some not"
        counts = batch["request_counts"]
        assert counts == {"total": len(prompts), "completed": len(done), "failed": len(expired)}
        assert sorted(r["custom_id"] for r in done + expired) == sorted(f"line-{i}" for i in range(len(prompts)))
        for row in done:
            prompt = prompts[int(row["custom_id"].split("-")[1])]
            assert row["response"]["body"]["choices"][0]["text"] == offline[prompt]
        assert {row["error"]["code"] for row in expired} == {"batch_expired"}
        # The lines that were running when it expired were cancelled: the worker's KV cache empties.
        wait_until(lambda: all(w["running"] == 0 and w["free_blocks"] == w["total_blocks"]
                               for w in api.get("/v1/workers").json()["data"]), timeout=30)


def batch_after_sweep(stack: LocalStack, batch_id: str) -> dict:
    """The batch's status read from the database until it is expired, then the batch from the API: a
    GET of a batch past its window expires it too, so polling the API would not show the sweep works."""
    engine = sqlalchemy.create_engine(stack.settings.database_url)
    with engine.connect() as connection:
        row = connection.execute(sqlalchemy.text("SELECT status FROM batches WHERE id = :id"),
                                 {"id": batch_id}).one()
    engine.dispose()
    if row.status != "expired":
        return {"status": row.status}
    with httpx.Client(base_url=stack.base_url, timeout=60) as api:
        return api.get(f"/v1/batches/{batch_id}").json()
