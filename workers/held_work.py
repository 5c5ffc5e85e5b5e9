"""The work a worker holds: every task it has taken from the broker and not yet finished, recorded
under `llmq:held:{instance}` (the work's key -> the work and its queue; the instance is this run of the
worker, as its heartbeats and leases name it: llmq/fleet.py) from the moment the task starts
until it ends.

A worker killed outright leaves this record behind, with its last heartbeat. So the heartbeats say
who is alive and this says what a dead worker had: the sweep (workers/sweeper.py) sends that work
to the queue again as soon as the worker's heartbeat is older than its leases (LLMQ_LEASE_SECONDS),
rather than waiting for the broker's visibility timeout, which cannot tell a dead worker's task
from a long one and redelivers both after the same time. The work is resumed from its checkpoint;
a delivery that finds it finished or leased by a live worker skips it.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import orjson
import redis

from llmq.events import held_key
from workers.work import Work

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldEntry:
    """One held work, and the queue it goes back to."""

    work: Work
    queue: str

    def encode(self) -> bytes:
        return orjson.dumps({"task": self.work.task, "arg": self.work.arg, "priority": self.work.priority,
                             "queue": self.queue})

    @classmethod
    def decode(cls, raw: bytes) -> "HeldEntry":
        fields = orjson.loads(raw)
        return cls(Work(fields["task"], fields["arg"], fields["priority"]), fields["queue"])


_PREFIX = held_key("")


def holders(client: redis.Redis) -> list[str]:
    """The instances with a held-work record: live workers, and dead ones not yet swept."""
    return sorted(_text(record)[len(_PREFIX):] for record in client.scan_iter(match=held_key("*"), count=100))


def read_held(client: redis.Redis, instance: str) -> list[HeldEntry]:
    """What the instance holds, as its record says (in no particular order)."""
    return [HeldEntry.decode(raw) for raw in client.hvals(held_key(instance))]


def held_keys(client: redis.Redis) -> set[str]:
    """The keys of every work any worker holds, alive or dead (not yet swept)."""
    keys: set[str] = set()
    for instance in holders(client):
        keys.update(_text(k) for k in client.hkeys(held_key(instance)))
    return keys


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


class HeldWork:
    """This worker's record. Two deliveries of one task in this process share its entry: it goes when
    the last of them ends."""

    def __init__(self, client: redis.Redis, instance: str, queue: str):
        self.client, self.key, self.queue = client, held_key(instance), queue
        self._count: Counter[str] = Counter()
        self._lock = threading.Lock()

    @contextmanager
    def holding(self, work: Work) -> Iterator[None]:
        with self._lock:
            self._count[work.key] += 1
            first = self._count[work.key] == 1
        if first:
            self._write(lambda: self.client.hset(self.key, work.key, HeldEntry(work, self.queue).encode()))
        try:
            yield
        finally:
            with self._lock:
                self._count[work.key] -= 1
                last = not self._count[work.key]
                if last:
                    del self._count[work.key]
            if last:
                self._write(lambda: self.client.hdel(self.key, work.key))

    def held(self) -> int:
        """How many works this worker holds now."""
        with self._lock:
            return len(self._count)

    def clear(self) -> None:
        """A worker that stopped cleanly holds nothing (its handed-back tasks went back to the queue)."""
        self._write(lambda: self.client.delete(self.key))

    @staticmethod
    def _write(call) -> None:
        try:
            call()
        except redis.RedisError as err:  # the client has retried for a while: the work itself goes on
            log.warning("could not update this worker's held work: %s", err)
