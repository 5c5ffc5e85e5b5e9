"""The Celery app bound to the Flask app (`celery -A workers.celery_app worker`), and the worker's
start hooks: the engine is loaded and warmed when the worker starts, before it consumes a task.

The threads pool runs tasks in this process, so every task thread shares the one EngineService;
`worker_init` fires in this process before the consumer starts (`worker_process_init` would not:
it belongs to the prefork pool).
"""
from __future__ import annotations

import json
import logging
import threading
import time

import redis
from celery.signals import worker_init, worker_shutdown

from app import create_app
from app.streams import CANCEL_CHANNEL, WORKERS_KEY

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
    from workers.engine import EngineConfig, LLMEngine, SamplingParams
    from workers.publisher import StreamPublisher
    from workers.service import EngineService, install

    model_path = settings.resolved_model_path()

    def load_and_warm() -> LLMEngine:  # runs on the engine's loop thread (see EngineService)
        engine = LLMEngine(EngineConfig(model=str(model_path), **settings.engine_options()))
        engine.add_request("warmup", "Hello", SamplingParams(temperature=0, max_tokens=2))
        while engine.has_unfinished():
            engine.step()
        return engine

    client = flask_app.extensions["llmq_redis"]
    service = EngineService(load_and_warm, StreamPublisher(client, settings.stream_maxlen, settings.stream_ttl))
    service.start()
    install(service)
    name = getattr(sender, "hostname", None) or "worker"
    threading.Thread(target=_heartbeats, args=(client, service, name), daemon=True, name="llmq-heartbeat").start()
    threading.Thread(target=_listen_for_cancels, args=(client, service), daemon=True, name="llmq-cancels").start()
    log.info("worker %s serving %s from %s", name, settings.resolved_model_name(), model_path)


@worker_shutdown.connect
def stop_engine(**_):
    _stop.set()
    from workers.service import current_service

    try:
        current_service().stop()
    except RuntimeError:
        pass


def _heartbeats(client: redis.Redis, service, name: str) -> None:
    while not _stop.wait(settings.heartbeat_seconds):
        beat = {"model": settings.resolved_model_name(), "at": time.time(), **service.stats()}
        try:
            client.hset(WORKERS_KEY, name, json.dumps(beat))
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
