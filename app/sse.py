"""Server-Sent Events: the one encoder of what the web streams (OpenAI chunks, or llmq's own events)."""
from __future__ import annotations

import orjson

from llmq import events
from llmq.events import Event

HEARTBEAT = ": keep-alive\n\n"  # an SSE comment: clients ignore it, a gone client makes the write fail
DONE = "data: [DONE]\n\n"


def sse_data(obj: dict) -> str:
    return f"data: {orjson.dumps(obj).decode()}\n\n"


def sse_event(entry_id: str | None, event: Event) -> str:
    """A stream event as SSE, with the stream entry id so a client can resume (Last-Event-ID)."""
    head = f"id: {entry_id}\n" if entry_id else ""
    return f"{head}event: {event.type}\ndata: {events.encode(event).decode()}\n\n"
