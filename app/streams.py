"""Redis key names, the token message format, and the stream reader. The contract between workers
(who write) and anyone who reads: the web process, or your own plain Redis client.

Per request id:
  llmq:stream:{id}   a Redis Stream, one entry per event, field "data" = the event's JSON;
                     capped (MAXLEN ~) and expiring a while after the request ends; replayable
  llmq:tokens:{id}   a pub/sub channel; every event is also PUBLISHed here as the same JSON
  llmq:cancel:{id}   set when the request is cancelled; a task that sees it never starts
Shared:
  llmq:cancel        pub/sub channel of cancelled request ids; workers abort them at the next step
  llmq:workers       hash: worker name -> heartbeat JSON (model, running, waiting, free/total KV blocks, at)

Events (JSON):
  {"type": "delta", "index": i, "text": "...", "token_ids": [...], "logprobs": [...] | null,
   "finish_reason": null | "stop" | "length" | "abort", "t": unix time}
  {"type": "done", "usage": {...}, "t": ...}          the request finished (all choices)
  {"type": "error", "error": {"code", "message"}, "t": ...}
`index` is the choice index: prompt number * n + sample number.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator

import redis

CANCEL_CHANNEL = "llmq:cancel"
WORKERS_KEY = "llmq:workers"


def stream_key(request_id: str) -> str:
    return f"llmq:stream:{request_id}"


def tokens_channel(request_id: str) -> str:
    return f"llmq:tokens:{request_id}"


def cancel_key(request_id: str) -> str:
    return f"llmq:cancel:{request_id}"


def queue_events(pipe, request_id: str, events: list[dict], maxlen: int) -> None:
    """Add the commands that write `events` (stream entry + publish, each) to a pipeline."""
    for event in events:
        payload = json.dumps(event)
        pipe.xadd(stream_key(request_id), {"data": payload}, maxlen=maxlen, approximate=True)
        pipe.publish(tokens_channel(request_id), payload)


def publish_events(client: redis.Redis, request_id: str, events: list[dict], maxlen: int,
                   ttl: int | None = None) -> None:
    """Append events to the request's stream and publish them, in one round trip."""
    pipe = client.pipeline(transaction=False)
    queue_events(pipe, request_id, events, maxlen)
    if ttl is not None:
        pipe.expire(stream_key(request_id), ttl)
    pipe.execute()


def request_cancel(client: redis.Redis, request_id: str, ttl: int) -> None:
    pipe = client.pipeline(transaction=False)
    pipe.set(cancel_key(request_id), "1", ex=ttl)
    pipe.publish(CANCEL_CHANNEL, request_id)
    pipe.execute()


def is_cancelled(client: redis.Redis, request_id: str) -> bool:
    return bool(client.exists(cancel_key(request_id)))


def read_events(client: redis.Redis, request_id: str, last_id: str = "0-0", block_ms: int = 1000,
                timeout: float | None = None) -> Iterator[tuple[str | None, dict | None]]:
    """Yield (entry id, event) from the request's stream after `last_id`, waiting for new ones, until
    a done or error event. Yields (None, None) after each `block_ms` with nothing new, so a caller can
    check its client is still there. Stops after `timeout` seconds without any event."""
    key = stream_key(request_id)
    idle_since = time.monotonic()
    while True:
        reply = client.xread({key: last_id}, count=256, block=block_ms)
        if not reply:
            if timeout is not None and time.monotonic() - idle_since > timeout:
                return
            yield None, None
            continue
        idle_since = time.monotonic()
        for entry_id, fields in reply[0][1]:
            last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            data = fields.get(b"data") or fields.get("data")
            event = json.loads(data)
            yield last_id, event
            if event["type"] in ("done", "error"):
                return
