"""The worker's background threads: heartbeats (which renew its leases), the cancel listener, the
sweeper and the fleet's history. Each runs until `stop` is set.

Heartbeats start before the engine loads (state "starting"), so the fleet knows a worker is on its
way (the web queues requests for its model, the autoscaler counts it); once it is up they carry its
load and capacity (llmq/fleet.py says what a heartbeat holds)."""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections import deque

import redis
from celery import Celery

from llmq import fleet_history
from llmq.events import CANCEL_CHANNEL, SWEEP_LOCK_KEY, WORKERS_KEY
from llmq.settings import Settings
from workers.capacity import capacity
from workers.runtime import WorkerRuntime
from workers.sweeper import Sweeper

log = logging.getLogger(__name__)


class Heartbeat:
    """What this worker says of itself every LLMQ_HEARTBEAT_SECONDS. `runtime` is set once the engine
    is up; `draining` once the worker is told to stop."""

    RATE_WINDOW = 5  # beats over which tokens_per_s is measured

    def __init__(self, client: redis.Redis, settings: Settings, name: str, instance: str, started_at: float):
        self.client, self.settings, self.name, self.instance = client, settings, name, instance
        self.started_at = started_at
        self.ready_at: float | None = None
        self.runtime: WorkerRuntime | None = None
        self.draining = False
        self._tokens: deque[tuple[float, int]] = deque(maxlen=self.RATE_WINDOW + 1)
        self._stats: dict = {}

    def beat(self) -> dict:
        now = time.time()
        beat = {"instance": self.instance, "model": self.settings.resolved_model_name(), "at": now,
                "started_at": self.started_at, "ready_at": self.ready_at, "pid": os.getpid(),
                "host": socket.gethostname(), "max_num_seqs": self.settings.max_num_seqs}
        runtime = self.runtime
        if runtime is None:
            return {**beat, "state": "starting"}
        try:
            stats = self._stats = runtime.engine.stats()
        except Exception as err:  # the engine did not answer in time: still alive, say so with what it said last
            log.warning("heartbeat without fresh engine stats: %s", err)
            stats = self._stats
        held = runtime.held.held()
        self._tokens.append((now, stats.get("tokens", 0)))
        (then, before), (_, after) = self._tokens[0], self._tokens[-1]
        return {**beat, "state": "draining" if self.draining else "ready", **stats, "held": held,
                "capacity": 0 if self.draining else capacity(stats, self.settings.max_num_seqs, held),
                "tokens_per_s": round((after - before) / (now - then), 1) if now > then else 0.0,
                "tenant_threads": runtime.intake.in_flight()}

    def send(self) -> None:
        self.client.hset(WORKERS_KEY, self.name, json.dumps(self.beat()))


def start_heartbeats(heartbeat: Heartbeat, stop: threading.Event) -> None:
    threading.Thread(target=heartbeats, args=(heartbeat, stop), daemon=True, name="llmq-heartbeat").start()


def start(runtime: WorkerRuntime, celery_app: Celery, stop: threading.Event) -> None:
    for target, args, name in ((sweep, (runtime, celery_app, stop), "llmq-sweeper"),
                               (listen_for_cancels, (runtime, stop), "llmq-cancels"),
                               (record_history, (runtime, stop), "llmq-history")):
        threading.Thread(target=target, args=args, daemon=True, name=name).start()


def heartbeats(heartbeat: Heartbeat, stop: threading.Event) -> None:
    """Every heartbeat_seconds: this worker's state and load under llmq:workers and, once it runs, its
    leases renewed (a request whose lease another worker took is handed back) and parked work that its
    idle threads have room for sent back to the queue (workers/tenant_intake.py)."""
    client = heartbeat.client
    while True:
        try:
            heartbeat.send()
            runtime = heartbeat.runtime
            if runtime is not None:
                if not heartbeat.draining:
                    runtime.intake.resume_idle()
                for request_id in runtime.leases.renew_all():
                    runtime.engine.hand_back(request_id)
        except redis.RedisError as err:
            log.warning("heartbeat failed: %s", err)
        except Exception:  # whatever it was, the next beat tries again: this thread must not end
            log.exception("heartbeat failed")
        if stop.wait(heartbeat.settings.heartbeat_seconds):
            break
    try:
        client.hdel(WORKERS_KEY, heartbeat.name)
        if heartbeat.runtime is not None:
            heartbeat.runtime.held.clear()
    except redis.RedisError:
        pass


def listen_for_cancels(runtime: WorkerRuntime, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            pubsub = runtime.redis.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(CANCEL_CHANNEL)
            while not stop.is_set():
                message = pubsub.get_message(timeout=1.0)
                if message and message["type"] == "message":
                    request_id = message["data"].decode() if isinstance(message["data"], bytes) else message["data"]
                    runtime.engine.cancel(request_id)
        except redis.RedisError as err:  # Redis restarted: subscribe again
            log.warning("cancel listener lost Redis (%s); reconnecting", err)
            time.sleep(1)


def sweep(runtime: WorkerRuntime, celery_app: Celery, stop: threading.Event) -> None:
    """Every sweep_seconds, one worker (whoever takes the lock) runs the sweep (workers/sweeper.py)."""
    settings, client = runtime.settings, runtime.redis
    sweeper = Sweeper(runtime.db, client, celery_app, settings.lease_seconds, settings.stream_ttl)
    while not stop.wait(settings.sweep_seconds):
        try:
            if client.set(SWEEP_LOCK_KEY, "1", nx=True, ex=max(1, settings.sweep_seconds)):
                sweeper.sweep(time.time())
        except Exception:  # the next sweep tries again
            log.exception("sweep failed")


def record_history(runtime: WorkerRuntime, stop: threading.Event) -> None:
    """A few times a bucket, the fleet's sample for the dashboard's chart (llmq/fleet_history.py); the
    first worker to reach a bucket writes it, so each is written once however many workers run."""
    settings = runtime.settings
    while not stop.wait(fleet_history.BUCKET_S / 3):
        try:
            fleet_history.record_fleet(runtime.redis, {settings.resolved_model_name()}, settings.heartbeat_stale_after)
        except redis.RedisError as err:  # the next one tries again
            log.warning("fleet history not recorded: %s", err)
