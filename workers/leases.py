"""Leases: at most one worker runs a request at a time, even when the broker delivers its task twice.

A task can be delivered twice: Redis redelivers one still unacknowledged after the visibility timeout
(its worker died, or it is merely still running), and the sweep sends a dead worker's held work
again (workers/held_work.py). The lease (`llmq:lease:{id}`, the owner's name, expiring after `ttl_s`
unless the owner renews it with its heartbeats) and the owner's heartbeats tell the cases apart: a
delivery whose request is leased by a live worker is skipped; one leased by a worker whose heartbeats
stopped takes the request over once the lease lapses, resuming from the request's checkpoint.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import redis

from llmq.events import lease_key

log = logging.getLogger(__name__)

# Only the owner may renew or release: a stalled owner whose lease another worker has taken must not
# extend or delete the new owner's lease. A lease that is gone (it lapsed while Redis was away) is
# taken again: nobody else has it.
_RENEW_IF_OWNER = """
local owner = redis.call('get', KEYS[1])
if owner == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
if not owner then return redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2]) and 1 end
return 0
"""
_RELEASE_IF_OWNER = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


class Leases:
    def __init__(self, client: redis.Redis, owner: str, ttl_s: float):
        self.client, self.owner, self.ttl_ms = client, owner, int(ttl_s * 1000)
        self._held: set[str] = set()  # leases this worker holds (renewed with its heartbeats)
        self._in_process: set[str] = set()  # held, or being tried for, by a thread of this process
        self._lock = threading.Lock()
        self._renew = client.register_script(_RENEW_IF_OWNER)
        self._release = client.register_script(_RELEASE_IF_OWNER)

    def acquire(self, request_id: str) -> bool:
        with self._lock:  # this process runs a request once, whatever Redis says (a lapsed lease)
            if request_id in self._in_process:
                return False
            self._in_process.add(request_id)
        acquired = False
        try:
            acquired = bool(self.client.set(lease_key(request_id), self.owner, nx=True, px=self.ttl_ms))
        finally:
            with self._lock:
                if acquired:
                    self._held.add(request_id)
                else:
                    self._in_process.discard(request_id)
        return acquired

    def acquire_unless_alive(self, request_id: str, finished: Callable[[], bool], alive: Callable[[str], bool],
                             poll_s: float = 0.5) -> bool:
        """Take the lease, unless the worker holding it is alive (`alive(name)`: its heartbeats are
        fresh): then it is running the request, its held work names it should it die, and this
        delivery is a duplicate (False). A dead holder's lease lapses within its ttl: wait for that.
        False too if the request finishes meanwhile."""
        waited = False
        while not self.acquire(request_id):
            holder = self.client.get(lease_key(request_id))
            if holder is None:  # released or lapsed since: try again
                continue
            holder = holder.decode() if isinstance(holder, bytes) else holder
            if finished():
                return False
            if holder == self.owner or alive(holder):
                log.info("request %s is running on %s; this delivery of it is skipped", request_id, holder)
                return False
            if not waited:
                log.info("request %s was running on %s, which is gone; taking it over once its lease lapses",
                         request_id, holder)
                waited = True
            time.sleep(poll_s)
        return not finished()

    def release(self, request_id: str) -> None:
        with self._lock:
            self._held.discard(request_id)
            self._in_process.discard(request_id)
        try:
            self._release(keys=[lease_key(request_id)], args=[self.owner])
        except redis.RedisError as err:  # it lapses on its own
            log.warning("could not release the lease of %s: %s", request_id, err)

    def renew_all(self) -> list[str]:
        """Extend every lease this worker holds (called with each heartbeat). Returns the requests
        whose lease another worker holds now (this one stalled past the lease): they must stop here."""
        with self._lock:
            held = list(self._held)
        if not held:
            return []
        pipe = self.client.pipeline(transaction=False)
        for request_id in held:
            self._renew(keys=[lease_key(request_id)], args=[self.owner, self.ttl_ms], client=pipe)
        lost = [request_id for request_id, kept in zip(held, pipe.execute()) if not kept]
        for request_id in lost:
            log.warning("lost the lease of %s to another worker; stopping it here", request_id)
        return lost
