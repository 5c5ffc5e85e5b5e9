"""The fleet's history on a real Redis: one sample a bucket whoever writes first, made from the
heartbeats, the queues and the autoscaler's decision; old samples dropped."""
from __future__ import annotations

import json

from llmq import fleet, fleet_history
from llmq.events import WORKERS_KEY, history_key
from llmq.fleet_history import BUCKET_S, HISTORY_S

MODEL = "m"


def beat(r, name: str, at: float, state: str = "ready", running: int = 0, model: str = MODEL) -> None:
    r.hset(WORKERS_KEY, name, json.dumps({"instance": name, "model": model, "state": state, "at": at,
                                          "running": running}))


def test_a_sample_counts_serving_workers_their_sequences_the_queue_and_the_desired_count(redis_db):
    now = 100 * BUCKET_S + 3.0
    beat(redis_db, "a", now, running=3)
    beat(redis_db, "b", now, state="draining", running=1)
    beat(redis_db, "c", now - 60)  # dead
    redis_db.rpush(fleet.broker_list(MODEL, 0), "x", "y")
    redis_db.rpush(fleet.broker_list(MODEL, 9), "z")
    fleet.write_autoscaler(redis_db, MODEL, {"desired": 4, "actual": 1})
    assert fleet_history.record(redis_db, MODEL, stale_after=10, now=now)
    [recorded] = fleet_history.history(redis_db, MODEL, now=now)
    assert recorded == fleet_history.FleetSample(at=100 * BUCKET_S, queued=3, workers=1, running=3, desired=4)


def test_the_first_writer_of_a_bucket_wins_and_the_next_bucket_gets_its_own(redis_db):
    start = 200 * BUCKET_S
    assert fleet_history.record(redis_db, MODEL, 10, now=start + 1)
    redis_db.rpush(fleet.broker_list(MODEL, 0), "x")
    assert not fleet_history.record(redis_db, MODEL, 10, now=start + BUCKET_S - 1)  # the same bucket
    assert fleet_history.record(redis_db, MODEL, 10, now=start + BUCKET_S)
    samples = fleet_history.history(redis_db, MODEL, now=start + BUCKET_S)
    assert [(s.at, s.queued, s.desired) for s in samples] == [(start, 0, None), (start + BUCKET_S, 1, None)]


def test_samples_older_than_the_history_are_dropped(redis_db):
    start = 1000 * BUCKET_S
    fleet_history.record(redis_db, MODEL, 10, now=start)
    fleet_history.record(redis_db, MODEL, 10, now=start + HISTORY_S)
    assert redis_db.hlen(history_key(MODEL)) == 2  # exactly an hour apart: kept
    fleet_history.record(redis_db, MODEL, 10, now=start + HISTORY_S + BUCKET_S)
    assert sorted(int(k) for k in redis_db.hkeys(history_key(MODEL))) == [start + HISTORY_S, start + HISTORY_S + BUCKET_S]
    assert 0 < redis_db.ttl(history_key(MODEL)) <= 2 * HISTORY_S


def test_the_fleet_is_recorded_for_every_model_a_live_worker_serves(redis_db):
    now = 300 * BUCKET_S
    beat(redis_db, "a", now, model="other")
    fleet_history.record_fleet(redis_db, {MODEL}, stale_after=10, now=now)
    assert [s.workers for s in fleet_history.history(redis_db, "other", now=now)] == [1]
    assert [s.workers for s in fleet_history.history(redis_db, MODEL, now=now)] == [0]
