"""GET /metrics: the whole fleet in the Prometheus text format, from what Redis and the database hold.

A real Redis and a real migrated SQLite database; the workers' part of Redis is written as workers
write it: heartbeats whose "metrics" come from the real recorder and engine counters, tasks sent
through the web's Celery app (kombu's priority lists), work parked by a real TenantIntake, the
autoscaler's decision through llmq.fleet.write_autoscaler. The answer is parsed with
prometheus_client's own parser."""
from __future__ import annotations

import json
import time

from prometheus_client.parser import text_string_to_metric_families

from llmq.engine.counters import EngineCounters
from llmq.events import WORKERS_KEY
from llmq.fleet import write_autoscaler
from llmq.settings import queue_name
from llmq.store.models import Batch, BatchItem, File
from tests.api.conftest import ACCESS_MODEL
from workers.request_metrics import RequestMetrics
from workers.tenant_intake import TenantIntake
from workers.work import Work

STALE = 3 * 2 + 5  # the default LLMQ_HEARTBEAT_SECONDS (2): a heartbeat older than 11 s is gone


def scrape(client) -> dict[tuple[str, frozenset], float]:
    """Every sample of GET /metrics: (sample name, its labels) -> value."""
    response = client.get("/metrics")
    assert response.status_code == 200, response.get_data(as_text=True)
    assert response.content_type.startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(response.get_data(as_text=True)) for s in family.samples}


def of(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def names(samples: dict) -> set[str]:
    return {name for name, _ in samples}


def heartbeat(model: str = ACCESS_MODEL, age: float = 0.0, **fields) -> str:
    """A worker's heartbeat JSON as workers/background.py writes it (EngineService.stats() within)."""
    recorder = RequestMetrics()
    job = object()
    recorder.arrived(job, 0.0)
    recorder.scheduled(job, 0.25)
    recorder.delta(job, 0, 1, None, 0.5)
    recorder.delta(job, 0, 1, "stop", 0.5625)
    recorder.finished(job, 0.5625)
    counters = EngineCounters(prompt_tokens=7, generation_tokens=2, prefix_cache_queries=7, prefix_cache_hits=4,
                              num_preemptions=1)
    beat = {"model": model, "at": time.time() - age, "running": 3, "waiting": 1, "free_blocks": 30,
            "total_blocks": 40, "steps": 10, "busy_seconds": 0.5, "tokens": 2,
            "metrics": {**counters.as_dict(), **recorder.snapshot()}, **fields}
    return json.dumps(beat)


def test_an_empty_fleet_still_shows_the_served_models_queue_and_every_status(client):
    samples = scrape(client)
    for priority in ("0", "3", "6", "9"):
        assert of(samples, "llmq:queue_depth", model_name=ACCESS_MODEL, priority=priority) == 0
    for state in ("starting", "ready", "draining"):
        assert of(samples, "llmq:workers", model_name=ACCESS_MODEL, state=state) == 0
    for status in ("validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling",
                   "cancelled"):
        assert of(samples, "llmq:batches", status=status) == 0
    for status in ("completed", "failed", "cancelled"):
        assert of(samples, "llmq:batch_lines_done_total", status=status) == 0
    assert not any(name.startswith(("llmq:num_requests", "llmq:time_to_first", "llmq:autoscaler"))
                   for name in names(samples))


def test_each_live_worker_is_shown_with_its_load_counters_and_histograms(client, redis_db):
    redis_db.hset(WORKERS_KEY, mapping={"w1": heartbeat(), "w2": heartbeat(state="draining", free_blocks=40),
                                        "gone": heartbeat(age=STALE + 1)})
    samples = scrape(client)
    w1, w2 = {"model_name": ACCESS_MODEL, "worker": "w1"}, {"model_name": ACCESS_MODEL, "worker": "w2"}
    assert of(samples, "llmq:num_requests_running", **w1) == 3
    assert of(samples, "llmq:num_requests_waiting", **w1) == 1
    assert of(samples, "llmq:kv_cache_usage_perc", **w1) == 0.25
    assert of(samples, "llmq:kv_cache_usage_perc", **w2) == 0.0
    assert of(samples, "llmq:prompt_tokens_total", **w1) == 7
    assert of(samples, "llmq:generation_tokens_total", **w1) == 2
    assert of(samples, "llmq:prefix_cache_queries_total", **w1) == 7
    assert of(samples, "llmq:prefix_cache_hits_total", **w1) == 4
    assert of(samples, "llmq:num_preemptions_total", **w1) == 1
    assert of(samples, "llmq:request_success_total", **w1, finished_reason="stop") == 1
    assert of(samples, "llmq:request_success_total", **w1, finished_reason="length") == 0
    assert of(samples, "llmq:request_success_total", **w1, finished_reason="abort") == 0
    # Time to first token 0.5 s: in the bucket le=0.5 and every one above it, none below.
    assert of(samples, "llmq:time_to_first_token_seconds_bucket", **w1, le="0.25") == 0
    assert of(samples, "llmq:time_to_first_token_seconds_bucket", **w1, le="0.5") == 1
    assert of(samples, "llmq:time_to_first_token_seconds_bucket", **w1, le="2560.0") == 1
    assert of(samples, "llmq:time_to_first_token_seconds_bucket", **w1, le="+Inf") == 1
    assert of(samples, "llmq:time_to_first_token_seconds_count", **w1) == 1
    assert of(samples, "llmq:time_to_first_token_seconds_sum", **w1) == 0.5
    assert of(samples, "llmq:inter_token_latency_seconds_bucket", **w1, le="0.05") == 0
    assert of(samples, "llmq:inter_token_latency_seconds_bucket", **w1, le="0.075") == 1  # 0.0625
    assert of(samples, "llmq:e2e_request_latency_seconds_bucket", **w1, le="0.8") == 1  # 0.5625
    assert of(samples, "llmq:e2e_request_latency_seconds_bucket", **w1, le="0.5") == 0
    assert of(samples, "llmq:request_queue_time_seconds_bucket", **w1, le="0.3") == 1  # 0.25
    assert of(samples, "llmq:request_queue_time_seconds_count", **w2) == 1
    assert of(samples, "llmq:workers", model_name=ACCESS_MODEL, state="ready") == 1  # no state: ready
    assert of(samples, "llmq:workers", model_name=ACCESS_MODEL, state="draining") == 1
    assert of(samples, "llmq:workers", model_name=ACCESS_MODEL, state="starting") == 0
    assert not any(dict(labels).get("worker") == "gone" for _, labels in samples)


def test_a_worker_of_another_model_or_still_loading_shows_only_what_it_reports(client, redis_db):
    redis_db.hset(WORKERS_KEY, mapping={"other": heartbeat(model="other-model"),
                                        "loading": json.dumps({"model": ACCESS_MODEL, "state": "starting",
                                                               "at": time.time()})})
    samples = scrape(client)
    assert of(samples, "llmq:generation_tokens_total", model_name="other-model", worker="other") == 2
    assert of(samples, "llmq:workers", model_name="other-model", state="ready") == 1
    assert of(samples, "llmq:queue_depth", model_name="other-model", priority="0") == 0
    assert of(samples, "llmq:workers", model_name=ACCESS_MODEL, state="starting") == 1
    assert not any(dict(labels).get("worker") == "loading" for _, labels in samples)


def test_queue_depth_counts_the_brokers_messages_and_the_parked_work_by_priority(app, client, redis_db):
    celery = app.extensions["llmq"].celery
    for priority in (0, 0, 0, 6, 7):
        celery.send_task("llmq.complete", args=["req"], queue=queue_name(ACCESS_MODEL), priority=priority)
    intake = TenantIntake(redis_db, ACCESS_MODEL, 4, 2, lambda tenant: 1.0, lambda work: None)
    intake.park("acme", Work("llmq.complete", "parked-1", 0), Work("llmq.run_batch_line", 5, 6))
    samples = scrape(client)
    depth = {p: of(samples, "llmq:queue_depth", model_name=ACCESS_MODEL, priority=p) for p in ("0", "3", "6", "9")}
    assert depth == {"0": 3 + 1, "3": 0, "6": 2 + 1, "9": 0}


def test_the_autoscalers_latest_live_decisions(client, redis_db):
    write_autoscaler(redis_db, ACCESS_MODEL, {"desired": 3, "actual": 2, "min": 0, "max": 4, "backend": "local"})
    redis_db.hset("llmq:autoscaler", "old-model", json.dumps({"desired": 9, "actual": 9, "at": time.time() - 60}))
    samples = scrape(client)
    assert of(samples, "llmq:autoscaler_desired_workers", model_name=ACCESS_MODEL) == 3
    assert of(samples, "llmq:autoscaler_actual_workers", model_name=ACCESS_MODEL) == 2
    assert not any(dict(labels).get("model_name") == "old-model" for _, labels in samples)


def test_batches_by_status_and_the_lines_done(app, client):
    with app.extensions["llmq"].db.session() as session:
        upload = File(filename="in.jsonl", purpose="batch", bytes=2, content=b"{}")
        session.add(upload)
        session.flush()
        batches = [Batch(endpoint="/v1/completions", model=ACCESS_MODEL, input_file_id=upload.id, status=status)
                   for status in ("in_progress", "in_progress", "completed", "cancelled")]
        session.add_all(batches)
        session.flush()
        session.add_all(BatchItem(batch_id=batches[0].id, line=i, status=status) for i, status in enumerate(
            ("pending", "running", "completed", "completed", "failed", "cancelled", "completed")))
    samples = scrape(client)
    assert of(samples, "llmq:batches", status="in_progress") == 2
    assert of(samples, "llmq:batches", status="completed") == 1
    assert of(samples, "llmq:batches", status="cancelled") == 1
    assert of(samples, "llmq:batches", status="validating") == 0
    assert of(samples, "llmq:batch_lines_done_total", status="completed") == 3
    assert of(samples, "llmq:batch_lines_done_total", status="failed") == 1
    assert of(samples, "llmq:batch_lines_done_total", status="cancelled") == 1


def test_metrics_need_no_key_once_keys_exist(app, client, new_key):
    new_key(app, "acme")
    assert client.get("/v1/models").status_code == 401
    assert client.get("/metrics").status_code == 200


def test_every_web_process_answers_alike(make_app, redis_db):
    # Two apps on one Redis and one database, as two gunicorn processes: the state is theirs, not the app's.
    apps = [make_app(), make_app()]
    redis_db.hset(WORKERS_KEY, "w1", heartbeat())
    first, second = (scrape(a.test_client()) for a in apps)
    assert first == second and of(first, "llmq:generation_tokens_total", model_name=ACCESS_MODEL, worker="w1") == 2
