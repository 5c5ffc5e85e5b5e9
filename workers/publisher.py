"""A worker's writes to the request streams (llmq/streams.py): an engine step's events, or one event
that ends a request outside the engine loop."""
from __future__ import annotations

import redis

from llmq.events import Event
from llmq.streams import EventWrite, publish_events, write_events


class StreamPublisher:
    def __init__(self, client: redis.Redis, maxlen: int, ttl: int):
        self.client, self.maxlen, self.ttl = client, maxlen, ttl

    def publish(self, events: dict[str, tuple[int, list[Event]]], finished: list[str] = (),
                stream_lengths: dict[str, int] | None = None) -> None:
        """All of one step's events, every request, in one atomic script call: request id -> (the
        number of its first event here, its events). A retried call (after a dropped connection)
        writes nothing twice: the streams are the requests' checkpoints. `stream_lengths`: the most
        events each request can make; its stream's cap is never below it (LLMQ_STREAM_MAXLEN is the
        floor), so a replay from the start is whole however many choices and tokens it has."""
        lengths = stream_lengths or {}
        write_events(self.client, [EventWrite(request_id, request_events, first_number,
                                              self.ttl if request_id in finished else None,
                                              max(self.maxlen, lengths.get(request_id, 0)))
                                   for request_id, (first_number, request_events) in events.items()])

    def publish_one(self, request_id: str, event: Event, finished: bool = False) -> None:
        """One event after the request's last (the error that ends a request outside the engine loop);
        the stream is not trimmed for it."""
        publish_events(self.client, request_id, [event], ttl=self.ttl if finished else None)
