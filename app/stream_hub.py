"""StreamHub: one Redis reader per web process for every request stream it is serving.

Without it, every SSE client and every waiting completion held a Redis connection of its own,
blocked in an XREAD on its request's stream: a web process serving N streams held N connections,
and each engine step woke N of them for N replies. The hub's one thread reads all of those streams
with a single XREAD (BLOCK) and hands each new entry to the readers of its stream, which wait on a
queue. A reader that joins wakes the hub (an entry on the hub's own wake stream, which the XREAD
always includes), so its stream is read at once rather than after the current block. The thread
starts with the first reader and ends when none has been left for IDLE_EXIT_S.

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

from app.streams import entry_id_key, stream_entry, stream_key

log = logging.getLogger(__name__)

_WAKE_TTL_S = 3600  # the wake stream of a web process that died goes away by itself


class _Reader:
    """One consumer of one stream: the hub puts lists of (entry id, data) on its queue, in order."""

    def __init__(self, key: str, last_id: str):
        self.key = key
        self.last_id = last_id  # the last entry handed over (kept by the hub thread)
        self.queue: queue.SimpleQueue[list[tuple[str, bytes]]] = queue.SimpleQueue()


class StreamHub:
    IDLE_EXIT_S = 5.0

    def __init__(self, client: redis.Redis, block_ms: int = 1000, count: int = 256):
        self._client = client
        self._block_ms = block_ms
        self._count = count
        self._wake_key = f"llmq:web-wake:{uuid.uuid4().hex}"
        self._wake_last_id = "0-0"
        self._readers: dict[str, set[_Reader]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def read_events(self, request_id: str, last_id: str = "0-0", idle_s: float = 1.0,
                    timeout: float | None = None) -> Iterator[tuple[str | None, dict | None]]:
        """Yield (entry id, event) from the request's stream after `last_id`, waiting for new ones,
        until a done or error event. Yields (None, None) after each `idle_s` with nothing new, so a
        caller can check its client is still there; stops after `timeout` seconds without any event."""
        reader = _Reader(stream_key(request_id), last_id)
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
                for entry_id, data in entries:
                    event = orjson.loads(data)
                    yield entry_id, event
                    if event["type"] in ("done", "error"):
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
        pipe = self._client.pipeline(transaction=False)
        pipe.xadd(self._wake_key, {"w": "1"}, maxlen=1, approximate=False)
        pipe.expire(self._wake_key, _WAKE_TTL_S)
        pipe.execute()

    def _positions(self) -> dict[str, str] | None:
        """Each stream's position for the next XREAD (its furthest-behind reader's), or None when the
        hub has had no readers for IDLE_EXIT_S: the thread then ends (under the lock, so a reader
        joining at that moment starts a new one)."""
        deadline = time.monotonic() + self.IDLE_EXIT_S
        while True:
            with self._lock:
                if self._readers:
                    positions = {key: min((r.last_id for r in readers), key=entry_id_key)
                                 for key, readers in self._readers.items()}
                    positions[self._wake_key] = self._wake_last_id
                    return positions
                if time.monotonic() > deadline:
                    self._thread = None
                    return None
            time.sleep(0.05)

    def _run(self) -> None:
        while (positions := self._positions()) is not None:
            try:
                received = self._read(positions)
            except redis.RedisError as err:  # Redis restarting: the readers wait (their heartbeats go on)
                log.warning("stream hub: reading %d stream(s) failed, retrying: %s", len(positions) - 1, err)
                time.sleep(0.5)
                continue
            except Exception:  # never let the thread die under the readers that wait on it
                log.exception("stream hub: unexpected error; retrying")
                time.sleep(0.5)
                continue
            handed = [(reader, fresh) for key, entries in received.items()
                      for reader, fresh in self._hand_over(key, entries, read_after=positions[key])]
            # Wake the readers only now: each woken thread competes with this one for the interpreter,
            # so waking them during the hand-over made it take several times as long.
            for reader, fresh in handed:
                reader.queue.put(fresh)

    def _read(self, positions: dict[str, str]) -> dict[str, list[tuple[str, bytes]]]:
        """The entries after `positions`, by stream: a blocked XREAD, then one more without BLOCK for
        the streams it left out. Redis before 7.2 answers a blocked XREAD with the first of its streams
        to get an entry only, though a worker's step has written to all of them at once: reading the
        rest before handing anything over wakes each reader once per step, and no early reader's thread
        competes with this one for the interpreter while the rest are read."""
        received = self._decode(self._client.xread(positions, count=self._count, block=self._block_ms))
        if received and len(positions) > 2:  # more than one request stream (and the wake stream)
            after = {key: received[key][-1][0] if key in received else position for key, position in positions.items()}
            for key, entries in self._decode(self._client.xread(after, count=self._count)).items():
                received.setdefault(key, []).extend(entries)
        if self._wake_key in received:
            self._wake_last_id = received.pop(self._wake_key)[-1][0]
        return received

    @staticmethod
    def _decode(reply) -> dict[str, list[tuple[str, bytes]]]:
        return {(key.decode() if isinstance(key, bytes) else key): [stream_entry(entry) for entry in entries]
                for key, entries in reply or ()}

    def _hand_over(self, key: str, entries: list[tuple[str, bytes]],
                   read_after: str) -> list[tuple[_Reader, list[tuple[str, bytes]]]]:
        """Which reader of `key` gets which entries (those past its position), from a read of the
        entries after `read_after`; moves each reader's position past them. A reader whose position is
        before that (it joined during the read) gets nothing from it: the read does not hold all it
        needs. The next read starts at its position."""
        read_from = entry_id_key(read_after)
        handed = []
        with self._lock:
            for reader in self._readers.get(key, ()):
                after = entry_id_key(reader.last_id)
                if after < read_from:
                    continue
                fresh = [entry for entry in entries if entry_id_key(entry[0]) > after]
                if fresh:
                    reader.last_id = fresh[-1][0]
                    handed.append((reader, fresh))
        return handed
