"""The fleet over the last hour, for the dashboard's chart: per model, one sample per BUCKET_S
seconds of its waiting work, its serving workers and what its autoscaler wants.

Whoever watches the fleet anyway writes the samples: the worker that runs the sweep
(workers/background.py) and the autoscaler's tick. A sample is made from what Redis shows, the
same for every writer, so the first to reach a bucket writes it (HSETNX) and the others leave it.
A bucket no one wrote (no worker, no autoscaler: nothing was watching) is a gap in the chart, not
a zero. Redis-only: no Celery, no Flask, no torch.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import redis

from llmq import fleet
from llmq.events import history_key

BUCKET_S = 15
HISTORY_S = 3600


@dataclass(frozen=True)
class FleetSample:
    at: float  # the start of its bucket (unix seconds)
    queued: int  # requests waiting for a worker (llmq.fleet.queue_depth, every priority)
    workers: int  # live workers not draining
    running: int  # sequences in those workers' engines
    desired: int | None  # the autoscaler's latest decision, if one decides for this model


def bucket_start(now: float) -> int:
    return int(now // BUCKET_S * BUCKET_S)


def take_sample(client: redis.Redis, model: str, stale_after: float, now: float) -> FleetSample:
    beats = [b for b in fleet.live_workers(client, stale_after, model, now=now) if b.get("state") != "draining"]
    decision = fleet.autoscalers(client, stale_after, now=now).get(model)
    return FleetSample(at=bucket_start(now), queued=sum(fleet.queue_depth(client, model).values()),
                       workers=len(beats), running=sum(b.get("running", 0) for b in beats),
                       desired=None if decision is None else decision.get("desired"))


def record(client: redis.Redis, model: str, stale_after: float, now: float | None = None) -> bool:
    """Write this bucket's sample unless another writer has; drop samples older than HISTORY_S.
    Whether it wrote."""
    now = time.time() if now is None else now
    sample = take_sample(client, model, stale_after, now)
    key = history_key(model)
    if not client.hsetnx(key, str(sample.at), json.dumps(asdict(sample))):
        return False
    old = [field for field in client.hkeys(key) if int(field) < sample.at - HISTORY_S]
    if old:
        client.hdel(key, *old)
    client.expire(key, 2 * HISTORY_S)  # a model no longer watched leaves nothing behind
    return True


def record_fleet(client: redis.Redis, models: set[str], stale_after: float, now: float | None = None) -> None:
    """Record every given model and every model a live worker serves."""
    now = time.time() if now is None else now
    served = {beat["model"] for beat in fleet.live_workers(client, stale_after, now=now) if "model" in beat}
    for model in sorted(models | served):
        record(client, model, stale_after, now)


def history(client: redis.Redis, model: str, now: float | None = None, span_s: float = HISTORY_S) -> list[FleetSample]:
    """The model's samples of the last `span_s` seconds, oldest first."""
    now = time.time() if now is None else now
    samples = [FleetSample(**json.loads(raw)) for raw in client.hgetall(history_key(model)).values()]
    return sorted((s for s in samples if s.at > now - span_s), key=lambda s: s.at)
