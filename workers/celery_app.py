"""The Celery app bound to the Flask app (`celery -A workers.celery_app worker`), and the worker's
start hooks: the engine is loaded and warmed when the worker starts, before it consumes a task.

The threads pool runs tasks in this process, so every task thread shares the one EngineService;
`worker_init` fires in this process before the consumer starts (`worker_process_init` would not:
it belongs to the prefork pool).

A SIGTERM (Celery's warm shutdown; what a spot preemption notice becomes) stops the consumer, and
`worker_shutting_down` hands every request in flight back at once: their tokens are checkpointed in
their streams, so another worker resumes them after one prefill, instead of this one spending the
notice period finishing them while the rest wait. If the handing back itself hangs (a stuck device),
the process exits when the grace period ends, and the broker redelivers its tasks.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from functools import partial

import redis
from celery.signals import worker_init, worker_shutdown, worker_shutting_down

from app import create_app
from app.streams import CANCEL_CHANNEL, SWEEP_LOCK_KEY, WORKERS_KEY

flask_app = create_app()
celery_app = flask_app.extensions["celery"]
settings = flask_app.config["LLMQ"]
celery_app.conf.update(worker_pool="threads", worker_concurrency=settings.worker_threads or settings.max_num_seqs)

import workers.tasks  # noqa: E402,F401  (registers the tasks)

log = logging.getLogger(__name__)
_stop = threading.Event()


@worker_init.connect
def start_engine(sender=None, **_):
    """Load the model, warm it up, and start the engine loop, heartbeats and cancel listener."""
    from workers.publisher import StreamPublisher
    from workers.service import install

    model_path = settings.resolved_model_path()
    client = flask_app.extensions["llmq_redis"]
    publisher = StreamPublisher(client, settings.stream_maxlen, settings.stream_ttl)
    if settings.engine_process:
        from workers.engine_process import EngineOptions, EngineProcess

        service = EngineProcess(EngineOptions(
            str(model_path), settings.engine_options(), settings.resolved_redis_url(), settings.redis_retry_seconds,
            settings.stream_maxlen, settings.stream_ttl, settings.resolved_engine_nice(), settings.resolved_background_stream_writes(),
            logging.getLogger().getEffectiveLevel()), publisher)
    else:
        from workers.service import EngineService, load_and_warm

        service = EngineService(partial(load_and_warm, str(model_path), settings.engine_options()), publisher,
                                nice=settings.resolved_engine_nice(),
                                background_writes=settings.resolved_background_stream_writes())
    service.start()
    install(service)
    from workers.leases import Leases

    name = getattr(sender, "hostname", None) or "worker"
    leases = flask_app.extensions["llmq_leases"] = Leases(client, name, settings.lease_seconds)
    threading.Thread(target=_heartbeats, args=(client, service, name, leases), daemon=True,
                     name="llmq-heartbeat").start()
    threading.Thread(target=_sweep, args=(client,), daemon=True, name="llmq-sweeper").start()
    threading.Thread(target=_listen_for_cancels, args=(client, service), daemon=True, name="llmq-cancels").start()
    log.info("worker %s serving %s from %s", name, settings.resolved_model_name(), model_path)


@worker_shutting_down.connect
def hand_back_work(sig=None, **_):
    """SIGTERM or SIGINT: hand every request in flight back to the queue, within the grace period."""
    from workers.service import current_service

    log.warning("worker stopping (%s): handing its requests back to the queue", sig)
    try:
        current_service().hand_back()
    except RuntimeError:  # stopped before the engine was up
        return
    grace = settings.shutdown_grace_seconds
    watchdog = threading.Timer(grace, _exit_after_grace, args=(grace,))
    watchdog.daemon = True
    watchdog.start()


def _exit_after_grace(grace: float) -> None:
    log.error("the worker did not stop within its %d s grace period; exiting (the broker redelivers "
              "its unfinished tasks)", grace)
    os._exit(1)


@worker_shutdown.connect
def stop_engine(**_):
    _stop.set()
    from workers.service import current_service

    try:
        current_service().stop()
    except RuntimeError:
        pass


def _heartbeats(client: redis.Redis, service, name: str, leases) -> None:
    while not _stop.wait(settings.heartbeat_seconds):
        beat = {"model": settings.resolved_model_name(), "at": time.time(), **service.stats()}
        try:
            client.hset(WORKERS_KEY, name, json.dumps(beat))
            for request_id in leases.renew_all():
                service.hand_back(request_id)
        except redis.RedisError as err:
            log.warning("heartbeat failed: %s", err)
    try:
        client.hdel(WORKERS_KEY, name)
    except redis.RedisError:
        pass


def _listen_for_cancels(client: redis.Redis, service) -> None:
    while not _stop.is_set():
        try:
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(CANCEL_CHANNEL)
            while not _stop.is_set():
                message = pubsub.get_message(timeout=1.0)
                if message and message["type"] == "message":
                    request_id = message["data"].decode() if isinstance(message["data"], bytes) else message["data"]
                    service.cancel(request_id)
        except redis.RedisError as err:  # Redis restarted: subscribe again
            log.warning("cancel listener lost Redis (%s); reconnecting", err)
            time.sleep(1)


def _sweep(client: redis.Redis) -> None:
    """Every sweep_seconds, one worker (whoever takes the lock) runs the sweep (workers/sweeper.py)."""
    from workers.sweeper import Sweeper

    sweeper = Sweeper(flask_app.extensions["llmq_db"], client, celery_app, settings.visibility_timeout,
                      settings.stream_ttl)
    while not _stop.wait(settings.sweep_seconds):
        try:
            if client.set(SWEEP_LOCK_KEY, "1", nx=True, ex=max(1, settings.sweep_seconds)):
                sweeper.sweep(time.time())
        except Exception:  # the next sweep tries again
            log.exception("sweep failed")
