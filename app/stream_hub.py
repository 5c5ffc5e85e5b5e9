"""StreamHub: one Redis subscription per web process for every request stream it is serving.

Without it, every SSE client and every waiting completion held a Redis connection of its own,
blocked in an XREAD on its request's stream: a web process serving N streams held N connections,
and each engine step woke N of them for N replies. The hub's one thread instead subscribes to
STEPS_CHANNEL, where each worker's write (one per engine step) is published whole, as one message:
a step's events for all of its requests reach the hub in one push, and it hands each reader of one
of those streams its events, in order, on the reader's queue.

Pub/sub delivers a message only to whoever is subscribed when it is published, so the streams stay
the record: a reader is caught up from its stream (XRANGE after its position) when it joins, when
an event reaches it with a gap before it, and whenever the subscription is (re)made. A step's
message is published after its entries are written, so a catch-up read holds every event a message
has brought; event numbers tell what a reader has had, so it gets nothing twice. A reader that joins
wakes the hub (a message on the hub's own wake channel) so its catch-up does not wait for the next
step. The thread starts with the first reader and ends when none has been left for IDLE_EXIT_S.

A stream's events are numbered without a gap from 1, so a catch-up that finds its next event gone
(Redis evicted or trimmed the stream's start) knows that the replay cannot be whole: instead of text
that differs from the request's result without saying so, the reader gets one error event,
`stream_incomplete`, that says where the whole result is.

A plain Redis client reads a stream the same way: XREAD from the last entry id it has (README.md).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterator

import orjson
import redis

from llmq import events
from llmq.events import STEPS_CHANNEL, DeltaEvent, ErrorEvent, Event, stream_key
from llmq.streams import entry_id_key, stream_entry

log = logging.getLogger(__name__)

Entry = tuple[str, Event]  # (stream entry id "0-<n>", the event)


class _Reader:
    """One consumer of one stream: the hub puts lists of (entry id, event) on its queue, in order."""

    def __init__(self, request_id: str, last_id: str):
        self.request_id = request_id
        self.key = stream_key(request_id)
        self.last_id = last_id  # the last entry handed over (kept by the hub thread)
        self.caught_up = False  # False: the next hand-over to it must come from its stream, not a message
        self.queue: queue.SimpleQueue[list[Entry]] = queue.SimpleQueue()


class StreamHub:
    IDLE_EXIT_S = 5.0

    def __init__(self, client: redis.Redis, block_ms: int = 1000):
        self._client = client
        self._block_s = block_ms / 1000
        self._wake_channel = f"llmq:web-wake:{uuid.uuid4().hex}"
        self._readers: dict[str, set[_Reader]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def read_events(self, request_id: str, last_id: str = "0-0", idle_s: float = 1.0,
                    timeout: float | None = None) -> Iterator[tuple[str | None, Event | None]]:
        """Yield (entry id, event) from the request's stream after `last_id`, waiting for new ones,
        until a done or error event. Yields (None, None) after each `idle_s` with nothing new, so a
        caller can check its client is still there; stops after `timeout` seconds without any event."""
        reader = _Reader(request_id, last_id)
        try:
            self._join(reader)
            idle_since = time.monotonic()
            while True:
                try:
                    entries = reader.queue.get(timeout=idle_s)
                except queue.Empty:
                    if timeout is not None and time.monotonic() - idle_since > timeout:
                        return
                    yield None, None
                    continue
                idle_since = time.monotonic()
                for entry_id, event in entries:
                    yield entry_id, event
                    if not isinstance(event, DeltaEvent):  # done or error: the request's last
                        return
        finally:
            with self._lock:
                readers = self._readers.get(reader.key)
                if readers is not None:
                    readers.discard(reader)
                    if not readers:
                        del self._readers[reader.key]

    def _join(self, reader: _Reader) -> None:
        with self._lock:
            self._readers.setdefault(reader.key, set()).add(reader)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="llmq-stream-hub", daemon=True)
                self._thread.start()
                return  # a new thread catches up every reader once it has subscribed
        self._client.publish(self._wake_channel, b"")

    def _active(self, idle_since: float | None) -> tuple[bool, float | None]:
        """Whether the thread goes on, and since when it has had no readers: after IDLE_EXIT_S without
        any it ends (under the lock, so a reader joining at that moment starts a new one)."""
        with self._lock:
            if self._readers:
                return True, None
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since > self.IDLE_EXIT_S:
                self._thread = None
                return False, idle_since
            return True, idle_since

    def _run(self) -> None:
        subscription, idle_since = None, None
        try:
            while True:
                going_on, idle_since = self._active(idle_since)
                if not going_on:
                    return
                # With no readers, wait no longer than the rest of the idle time.
                wait_s = self._block_s if idle_since is None else \
                    min(self._block_s, max(0.0, self.IDLE_EXIT_S - (time.monotonic() - idle_since)))
                try:
                    if subscription is None:
                        subscription = self._client.pubsub()
                        subscription.subscribe(STEPS_CHANNEL, self._wake_channel)
                    self._serve(subscription, wait_s)
                except redis.RedisError as err:  # Redis restarting: the readers wait (their heartbeats go on)
                    log.warning("stream hub: reading the token events failed, retrying: %s", err)
                    subscription = self._close(subscription)
                    time.sleep(0.5)
                except Exception:  # never let the thread die under the readers that wait on it
                    log.exception("stream hub: unexpected error; retrying")
                    subscription = self._close(subscription)
                    time.sleep(0.5)
        finally:
            self._close(subscription)

    @staticmethod
    def _close(subscription) -> None:
        if subscription is not None:
            try:
                subscription.close()
            except redis.RedisError:
                pass
        return None

    def _serve(self, subscription, wait_s: float) -> None:
        """Wait for messages (up to `wait_s`), take every one already there, hand their events over,
        then catch up every reader that needs it; wake the readers only after all of that."""
        messages, message = [], subscription.get_message(timeout=wait_s)
        while message is not None:
            messages.append(message)
            message = subscription.get_message(timeout=0.0)
        steps = []
        for message in messages:
            if message["type"] == "subscribe":  # (re)subscribed: what was published before is unseen
                self._mark_all_behind()
            elif message["type"] == "message" and message["channel"] in (STEPS_CHANNEL.encode(), STEPS_CHANNEL):
                steps.append(message["data"])
        handed: dict[_Reader, list[Entry]] = {}
        for data in steps:
            with self._lock:
                if not self._readers:  # another web process's requests only
                    continue
            self._route(orjson.loads(data), handed)
        self._catch_up(handed)
        # Wake the readers only now: each woken thread competes with this one for the interpreter,
        # so waking them during the hand-over made it take several times as long.
        for reader, entries in handed.items():
            reader.queue.put(entries)

    def _mark_all_behind(self) -> None:
        with self._lock:
            for readers in self._readers.values():
                for reader in readers:
                    reader.caught_up = False

    def _route(self, step: list[list], handed: dict[_Reader, list[Entry]]) -> None:
        """Hand over one step message's events ([stream key, event number, event] each) to the readers
        whose next event each one is. A reader that is not caught up, or finds a gap before an event
        (it joined after the events between, or a message was lost), is left behind: `_catch_up`
        reads its stream from its position."""
        with self._lock:
            for key, number, event in step:
                entry_id = f"0-{number}"
                for reader in self._readers.get(key, ()):
                    if not reader.caught_up:
                        continue
                    position = entry_id_key(reader.last_id)
                    if (0, number) <= position:  # it has this one already
                        continue
                    if position == (0, number - 1):
                        reader.last_id = entry_id
                        handed.setdefault(reader, []).append((entry_id, events.from_dict(event)))
                    else:
                        reader.caught_up = False

    def _catch_up(self, handed: dict[_Reader, list[Entry]]) -> None:
        """Read the streams of the readers left behind, each from its position, in one round trip."""
        with self._lock:
            behind = [(reader, reader.last_id) for readers in self._readers.values()
                      for reader in readers if not reader.caught_up]
        if not behind:
            return
        pipe = self._client.pipeline(transaction=False)
        for reader, position in behind:
            pipe.xrange(reader.key, min=f"({position}")
        replies = pipe.execute(raise_on_error=False)
        with self._lock:
            for (reader, position), entries in zip(behind, replies):
                if isinstance(entries, redis.ConnectionError):
                    raise entries  # the readers stay behind; the thread retries
                if isinstance(entries, redis.ResponseError):  # no id comes after its position: nothing to read
                    log.warning("stream hub: reading %s after %s: %s", reader.key, position, entries)
                    entries = []
                fresh = [(entry_id, events.decode(data)) for entry_id, data in map(stream_entry, entries)]
                if fresh and _missing_before(position, fresh[0][0]):
                    fresh = [(None, _incomplete(reader.request_id, position, fresh[0][0]))]
                reader.caught_up = True
                if fresh:
                    reader.last_id = fresh[-1][0]
                    handed.setdefault(reader, []).extend(fresh)


def _missing_before(position: str, first_id: str) -> bool:
    """Whether the stream lacks events between a reader's position and the first entry read after it
    (ids "0-<n>", numbered from 1 without a gap)."""
    (ms, number), first = entry_id_key(position), entry_id_key(first_id)
    return ms == 0 and first[0] == 0 and first[1] > number + 1


def _incomplete(request_id: str, position: str, first_id: str) -> ErrorEvent:
    start, first = entry_id_key(position)[1] + 1, entry_id_key(first_id)[1]
    gone = f"event {start}" if first - 1 == start else f"events {start} to {first - 1}"
    return ErrorEvent("stream_incomplete",
                      f"this request's stream no longer holds {gone} (Redis evicted or trimmed them), so a replay "
                      f"from here would not be whole; GET /v1/requests/{request_id} has the request's result once "
                      "it has ended", t=time.time())

