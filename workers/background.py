"""The worker's background threads: heartbeats (which renew its leases), the cancel listener and
the sweeper. Each runs until `stop` is set."""
from __future__ import annotations

import json
import logging
import threading
import time

import redis
from celery import Celery

from llmq.events import CANCEL_CHANNEL, SWEEP_LOCK_KEY, WORKERS_KEY
from workers.runtime import WorkerRuntime
from workers.sweeper import Sweeper

log = logging.getLogger(__name__)


def start(runtime: WorkerRuntime, celery_app: Celery, stop: threading.Event) -> None:
    for target, args, name in ((heartbeats, (runtime, stop), "llmq-heartbeat"),
                               (sweep, (runtime, celery_app, stop), "llmq-sweeper"),
                               (listen_for_cancels, (runtime, stop), "llmq-cancels")):
        threading.Thread(target=target, args=args, daemon=True, name=name).start()


def heartbeats(runtime: WorkerRuntime, stop: threading.Event) -> None:
    """Every heartbeat_seconds: this worker's load under llmq:workers, its leases renewed (a request
    whose lease another worker took is handed back), and parked work that its idle threads have room
    for sent back to the queue (workers/tenant_intake.py)."""
    settings, client = runtime.settings, runtime.redis
    while not stop.wait(settings.heartbeat_seconds):
        beat = {"model": settings.resolved_model_name(), "at": time.time(), **runtime.engine.stats(),
                "tenant_threads": runtime.intake.in_flight()}
        try:
            client.hset(WORKERS_KEY, runtime.name, json.dumps(beat))
            runtime.intake.resume_idle()
            for request_id in runtime.leases.renew_all():
                runtime.engine.hand_back(request_id)
        except redis.RedisError as err:
            log.warning("heartbeat failed: %s", err)
    try:
        client.hdel(WORKERS_KEY, runtime.name)
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
    sweeper = Sweeper(runtime.db, client, celery_app, settings.visibility_timeout, settings.stream_ttl)
    while not stop.wait(settings.sweep_seconds):
        try:
            if client.set(SWEEP_LOCK_KEY, "1", nx=True, ex=max(1, settings.sweep_seconds)):
                sweeper.sweep(time.time())
        except Exception:  # the next sweep tries again
            log.exception("sweep failed")
