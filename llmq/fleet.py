"""The fleet as Redis shows it: the workers' heartbeats, each model's waiting work, and the
autoscaler's latest decisions. Read by the web (GET /v1/workers, /metrics, refusing a model nothing
serves), the sweep (a dead worker's work taken over) and the autoscaler; written by the workers'
heartbeats and by `llmq autoscale`. Redis-only: no Celery, no Flask, no torch.

A worker's heartbeat (a JSON object under `llmq:workers`, by worker name) says:
  instance              this run of the worker (its name and a token): what its leases and its held
                        work (llmq:held:{instance}) name, so a worker restarted under the same name
                        is never taken for the run that died
  model, state          the model it serves; "starting" (loading its engine), "ready", "draining"
                        (stopping: it hands its work back and takes none)
  at, started_at, ready_at, pid, host
  running, waiting, free_blocks, total_blocks, max_num_seqs
                        its engine's load, and `capacity`: how many more requests it takes now
  tokens_per_s          generated over its last few heartbeats
  dtype, quantization, tensor_parallel_size, pipeline_parallel_size, async_scheduling
  steps, busy_seconds, tokens   the engine loop's totals since it started
  metrics               its counters and request timings since it started, for GET /metrics
                        (llmq/metrics.py has their form)
A worker whose heartbeat is older than `stale_after` seconds is not alive: it died, or stalled so
long that its leases lapsed (LLMQ_LEASE_SECONDS).
"""
from __future__ import annotations

import json
import time
from bisect import bisect

import redis

from llmq.events import AUTOSCALER_KEY, WORKERS_KEY, parked_key, parked_tenants_key
from llmq.settings import queue_name

WORKER_STATES = ("starting", "ready", "draining")

# The broker's priority levels: kombu's Redis transport keeps one list per step, named
# "{queue}\x06\x16{step}" (the plain queue name for step 0), and a lower step is served first.
PRIORITY_STEPS = (0, 3, 6, 9)
_PRIORITY_SEPARATOR = "\x06\x16"
_PARKED_SCORE_PER_PRIORITY = 10 ** 15  # workers/tenant_intake.py: score = priority * 10^15 + order


def priority_step(priority: int) -> int:
    """The broker priority level a task sent with `priority` waits at."""
    return PRIORITY_STEPS[max(0, bisect(PRIORITY_STEPS, priority) - 1)]


def broker_list(model: str, step: int) -> str:
    queue = queue_name(model)
    return f"{queue}{_PRIORITY_SEPARATOR}{step}" if step else queue


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def heartbeats(client: redis.Redis) -> dict[str, dict]:
    """Every heartbeat in Redis, live or not, by worker name."""
    return {_text(name): json.loads(raw) for name, raw in client.hgetall(WORKERS_KEY).items()}


def is_alive(beat: dict, now: float, stale_after: float) -> bool:
    return now - beat.get("at", 0) <= stale_after


def live_workers(client: redis.Redis, stale_after: float, model: str | None = None,
                 now: float | None = None) -> list[dict]:
    """The live workers' heartbeats (each with its "name"), of one model or all, by name."""
    now = time.time() if now is None else now
    return [{"name": name, **beat} for name, beat in sorted(heartbeats(client).items())
            if is_alive(beat, now, stale_after) and (model is None or beat.get("model") == model)]


def live_instances(client: redis.Redis, stale_after: float, now: float | None = None) -> set[str]:
    """The `instance` of every worker whose heartbeat is fresh."""
    now = time.time() if now is None else now
    return {beat["instance"] for beat in heartbeats(client).values()
            if "instance" in beat and is_alive(beat, now, stale_after)}


def queue_depth(client: redis.Redis, model: str) -> dict[int, int]:
    """The model's requests waiting for a worker, by broker priority level: the messages in its
    queue and the work parked for its tenant's turn (workers/tenant_intake.py), which is waiting too."""
    pipe = client.pipeline(transaction=False)
    for step in PRIORITY_STEPS:
        pipe.llen(broker_list(model, step))
    tenants = [_text(t) for t in client.smembers(parked_tenants_key(model))]
    bounds = [(step, nxt) for step, nxt in zip(PRIORITY_STEPS, PRIORITY_STEPS[1:] + (10,))]
    for tenant in tenants:
        for step, nxt in bounds:
            pipe.zcount(parked_key(model, tenant), step * _PARKED_SCORE_PER_PRIORITY,
                        f"({nxt * _PARKED_SCORE_PER_PRIORITY}")
    counts = pipe.execute()
    depth = dict(zip(PRIORITY_STEPS, counts[:len(PRIORITY_STEPS)]))
    for i, count in enumerate(counts[len(PRIORITY_STEPS):]):
        depth[bounds[i % len(bounds)][0]] += count
    return depth


def write_autoscaler(client: redis.Redis, model: str, status: dict) -> None:
    """The autoscaler's decision for a model (desired, actual, min, max, backend), stamped `at` now."""
    client.hset(AUTOSCALER_KEY, model, json.dumps({**status, "at": time.time()}))


def autoscalers(client: redis.Redis, stale_after: float, now: float | None = None) -> dict[str, dict]:
    """The latest decision of each model's autoscaler, if it decided within `stale_after` seconds."""
    now = time.time() if now is None else now
    status = {_text(model): json.loads(raw) for model, raw in client.hgetall(AUTOSCALER_KEY).items()}
    return {model: s for model, s in status.items() if is_alive(s, now, stale_after)}


def is_served(client: redis.Redis, model: str, stale_after: float) -> bool:
    """Whether a request for `model` will be run: a live worker serves it (or is starting to), or a
    live autoscaler may start one (its maximum is above zero)."""
    if live_workers(client, stale_after, model):
        return True
    status = autoscalers(client, stale_after).get(model)
    return status is not None and status.get("max", 0) > 0
