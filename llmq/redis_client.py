"""The one way llmq makes a Redis client (the web, the worker and its engine process all use it)."""
from __future__ import annotations

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry


def redis_client(url: str, retry_seconds: float) -> redis.Redis:
    """A client that rides out a Redis restart: a call whose connection fails is retried (on a fresh
    connection) for about `retry_seconds` before the error reaches the caller."""
    backoff_cap = 1.0
    retry = Retry(ExponentialBackoff(cap=backoff_cap, base=0.05), retries=max(1, int(retry_seconds / backoff_cap)))
    return redis.Redis.from_url(url, health_check_interval=30, retry=retry,
                                retry_on_error=[redis.ConnectionError, redis.TimeoutError])
