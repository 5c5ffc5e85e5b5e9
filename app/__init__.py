"""The llmq web application (and the Celery app bound to it). Never imports torch."""
from __future__ import annotations

import logging

import redis
from celery import Celery, Task
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from flask import Flask

from app.config import Settings, queue_name
from app.database import Database
from app.stream_hub import StreamHub


def create_app(settings: Settings | None = None) -> Flask:
    """Application factory: settings, database, Redis, Celery, access (keys, limits, idempotency),
    blueprints, error handlers."""
    settings = settings or Settings.from_env()
    app = Flask(__name__)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    redis_url = settings.resolved_redis_url()
    app.config.update(
        LLMQ=settings,
        MAX_CONTENT_LENGTH=settings.max_upload_bytes,
        CELERY=_celery_config(settings, redis_url),
    )
    app.extensions["llmq_db"] = Database(settings.database_url)
    app.extensions["llmq_redis"] = redis_client(redis_url, settings.redis_retry_seconds)
    app.extensions["llmq_stream_hub"] = StreamHub(app.extensions["llmq_redis"])
    celery_init_app(app)

    from app import auth, idempotency, limits
    from app.api import register_blueprints
    from app.errors import register_error_handlers

    # In this order, before every request: who is calling (g.tenant; 401 without a valid key once keys
    # exist), then the key's request rate (429), then a retried POST's first answer (Idempotency-Key).
    app.before_request(auth.authenticate)
    app.before_request(limits.limit_request_rate)
    idempotency.init_app(app)
    register_blueprints(app)
    register_error_handlers(app)
    return app


def redis_client(url: str, retry_seconds: float) -> redis.Redis:
    """A client that rides out a Redis restart: a call whose connection fails is retried (on a fresh
    connection) for about `retry_seconds` before the error reaches the caller."""
    backoff_cap = 1.0
    retry = Retry(ExponentialBackoff(cap=backoff_cap, base=0.05), retries=max(1, int(retry_seconds / backoff_cap)))
    return redis.Redis.from_url(url, health_check_interval=30, retry=retry,
                                retry_on_error=[redis.ConnectionError, redis.TimeoutError])


def _celery_config(settings: Settings, redis_url: str) -> dict:
    return {
        "broker_url": redis_url,
        "broker_transport": "app.broker:Transport",  # kombu's Redis transport, minus restore-on-close
        "task_ignore_result": True,  # results live in the database and the token streams
        "task_serializer": "json",
        "accept_content": ["json"],
        "task_acks_late": True,  # a task is acknowledged when done, so a crashed worker's work is redelivered
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,  # the engine batches; an idle worker elsewhere should get work
        # Requests in flight carry on through a broker reconnect (their acks may be lost, so their tasks
        # come again, and find the work done or leased): cancelling them would throw away the tokens.
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        # Redis redelivers an unacknowledged task (its worker died) after visibility_timeout; consumers
        # look for such tasks every unacked_restore_interval seconds (throttle 1: on every look).
        "broker_transport_options": {"visibility_timeout": settings.visibility_timeout,
                                     "unacked_restore_interval": max(1, min(10, settings.visibility_timeout // 4)),
                                     "unacked_restore_throttle": 1},
        "broker_connection_retry_on_startup": True,
        "task_default_queue": queue_name(settings.resolved_model_name()),
        "worker_hijack_root_logger": False,
        "task_send_sent_event": True,  # Flower shows tasks from the moment they are queued
        "worker_send_task_events": True,
    }


def celery_init_app(app: Flask) -> Celery:
    """Flask's documented pattern: every task runs inside the app context."""

    class FlaskTask(Task):
        def __call__(self, *args, **kwargs):
            with app.app_context():
                return self.run(*args, **kwargs)

    celery_app = Celery(app.name, task_cls=FlaskTask)
    celery_app.config_from_object(app.config["CELERY"])
    celery_app.set_default()
    app.extensions["celery"] = celery_app
    return celery_app
