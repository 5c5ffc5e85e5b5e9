"""The Celery configuration that the web (which sends tasks) and the workers (which run them) share.

A plain dict: neither side's Celery app is built here, and this module imports no Celery.
"""
from __future__ import annotations

from llmq.settings import Settings, queue_name


def celery_config(settings: Settings) -> dict:
    """Celery's settings for these (bootstrapped) llmq settings."""
    return {
        "broker_url": settings.redis_url,
        "broker_transport": "llmq.broker:Transport",  # kombu's Redis transport, minus restore-on-close
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
