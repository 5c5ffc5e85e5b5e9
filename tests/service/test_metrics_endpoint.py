"""GET /metrics on the running service: a real Redis, a real Celery worker (its engine in its own
process) and the web server. The worker's figures reach the web only through its heartbeats (every
second in this stack), so each check waits for one; every figure is compared with what it was before
the test's own work, since the session's other tests share the worker."""
from __future__ import annotations

import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.service.conftest import MODEL_NAME, wait_until


def scrape(api) -> list[tuple[str, dict, float]]:
    response = api.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(response.text)
            for s in family.samples]


def total(samples, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`: by default over every worker of the
    served model; model_name=None for the series that have no model (batches)."""
    labels.setdefault("model_name", MODEL_NAME)
    return sum(value for sample, have, value in samples
               if sample == name and all(have.get(k) == v for k, v in labels.items()))


def has(samples, name: str) -> bool:
    return any(sample == name for sample, _, _ in samples)


def wait_idle(api) -> list:
    """The metrics once heartbeats sent after this call say nothing is queued, held or running on the
    workers, and no token was made since the previous scrape."""
    last, since = [], time.time()

    def quiet():
        workers = api.get("/v1/workers").json()["data"]
        if not workers or any(w.get("held", 0) or w["at"] <= since for w in workers):
            return False
        samples = scrape(api)
        tokens = total(samples, "llmq:generation_tokens_total")
        settled = last and last[-1] == tokens
        last.append(tokens)
        return (settled and has(samples, "llmq:generation_tokens_total")
                and not total(samples, "llmq:num_requests_running") and not total(samples, "llmq:num_requests_waiting")
                and not total(samples, "llmq:queue_depth") and samples)
    return wait_until(quiet, interval=1.2)


@pytest.fixture()
def idle(api):
    return wait_idle(api)


def test_a_completed_request_moves_the_counters_and_histograms_by_what_it_reports(api):
    # Work the session's other tests left (a request sent for later, a batch line) may still end in the
    # middle of this one's: then it measures again, with that work out of the way.
    for _ in range(3):
        before = wait_idle(api)
        reply = api.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Once upon a time",
                                                  "max_tokens": 9, "temperature": 0, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        after = wait_idle(api)  # settled: the heartbeats since the reply are in
        if total(after, "llmq:e2e_request_latency_seconds_count") - total(
                before, "llmq:e2e_request_latency_seconds_count") == 1:
            break

    def moved(name: str, **labels) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert moved("llmq:generation_tokens_total") == usage["completion_tokens"] == 9
    assert moved("llmq:prompt_tokens_total") == usage["prompt_tokens"]
    assert moved("llmq:request_success_total", finished_reason="length") == 1
    assert moved("llmq:request_success_total", finished_reason="stop") == 0
    for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert moved(f"llmq:{histogram}_seconds_count") == 1, histogram
        assert moved(f"llmq:{histogram}_seconds_bucket", le="+Inf") == 1, histogram
    assert moved("llmq:inter_token_latency_seconds_count") == 9 - 1
    assert moved("llmq:e2e_request_latency_seconds_sum") >= moved("llmq:time_to_first_token_seconds_sum") > 0
    assert total(after, "llmq:workers", state="ready") >= 1
    assert total(after, "llmq:kv_cache_usage_perc") == 0  # idle again: every block free


def test_a_long_request_shows_running_and_waiting_then_every_choice_ends_once(api, idle):
    before = idle
    # 4 prompts x 16 samples of 480 tokens: the 16 slots are full for over a thousand steps (seconds, many
    # heartbeats, on a fast machine too), and prompts wait.
    prompts = ["Once upon a time", "The dog", "Lily wanted to", "One day, Tom"]
    submitted = api.post("/v1/requests", json={"model": MODEL_NAME, "prompt": prompts,
                                               "n": 16, "max_tokens": 480, "temperature": 1.0, "seed": 1,
                                               "ignore_eos": True})
    assert submitted.status_code == 202, submitted.text
    request_id = submitted.json()["id"]
    busy = wait_until(lambda: (s := scrape(api)) and total(s, "llmq:num_requests_running") > 0 and s, interval=0.1)
    assert total(busy, "llmq:num_requests_running") <= 16
    assert total(busy, "llmq:num_requests_waiting") >= 1  # the other prompt, or its samples
    assert 0 < total(busy, "llmq:kv_cache_usage_perc") <= 1
    assert api.post(f"/v1/requests/{request_id}/cancel").status_code == 200
    wait_until(lambda: api.get(f"/v1/requests/{request_id}").json()["status"] in ("cancelled", "completed"))
    ended = ("abort", "length", "stop")
    after = wait_until(lambda: (s := scrape(api)) and not total(s, "llmq:num_requests_running")
                       and sum(total(s, "llmq:request_success_total", finished_reason=r) for r in ended)
                       >= sum(total(before, "llmq:request_success_total", finished_reason=r) for r in ended) + 64
                       and s)
    moved = {r: total(after, "llmq:request_success_total", finished_reason=r)
             - total(before, "llmq:request_success_total", finished_reason=r) for r in ended}
    assert sum(moved.values()) == 4 * 16 and moved["abort"] >= 1  # each choice once
    assert total(after, "llmq:e2e_request_latency_seconds_count") \
        - total(before, "llmq:e2e_request_latency_seconds_count") == 1  # a cancelled request finishes too


def test_queue_depth_counts_work_waiting_for_a_thread_and_drains(api, idle):
    # One tenant may hold max_num_seqs (16) of the worker's task threads: the rest of its work is parked.
    # 16 samples each, so the first 16 requests hold their threads for seconds (16 x 16 sequences through
    # 16 slots) while the last 8 arrive: those wait, however fast the machine.
    ids = []
    for _ in range(24):
        submitted = api.post("/v1/requests", json={"model": MODEL_NAME, "prompt": "Once upon a time", "n": 16,
                                                   "max_tokens": 480, "temperature": 1.0, "ignore_eos": True})
        assert submitted.status_code == 202, submitted.text
        ids.append(submitted.json()["id"])
    try:
        queued = wait_until(lambda: (s := scrape(api)) and total(s, "llmq:queue_depth") > 0 and s, interval=0.05)
        assert total(queued, "llmq:queue_depth", priority="0") == total(queued, "llmq:queue_depth")
    finally:
        for request_id in ids:
            api.post(f"/v1/requests/{request_id}/cancel")
    wait_until(lambda: all(api.get(f"/v1/requests/{i}").json()["status"] in ("cancelled", "completed") for i in ids))
    wait_until(lambda: total(scrape(api), "llmq:queue_depth") == 0)


def test_batches_and_their_lines_by_status(api):
    def counts():
        samples = scrape(api)
        return ({status: total(samples, "llmq:batches", model_name=None, status=status)
                 for status in ("in_progress", "completed")},
                total(samples, "llmq:batch_lines_done_total", model_name=None, status="completed"))

    batches_before, lines_before = counts()
    lines = [json.dumps({"custom_id": f"m{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": MODEL_NAME, "prompt": "Once", "max_tokens": 3}}) for i in range(3)]
    upload = api.post("/v1/files", files={"file": ("in.jsonl", "\n".join(lines).encode())}, data={"purpose": "batch"})
    batch_id = api.post("/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint": "/v1/completions",
                                             "completion_window": "24h"}).json()["id"]
    wait_until(lambda: api.get(f"/v1/batches/{batch_id}").json()["status"] == "completed")
    batches_after, lines_after = counts()
    assert batches_after["completed"] - batches_before["completed"] == 1
    assert lines_after - lines_before == 3
