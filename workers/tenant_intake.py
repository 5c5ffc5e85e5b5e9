"""A worker's task threads, shared fairly between tenants, and the work parked until its turn.

A task holds its thread for as long as its request runs, so a tenant that floods the queue would
otherwise take every thread of every worker, and another tenant's request would wait at the broker
until one of the flood's requests ended, however fair the engine is once a request is in it. So a
tenant holds at most LLMQ_TENANT_THREADS of a worker's threads (by default max_num_seqs, enough to
keep the engine full on its own). A task of a tenant at that limit does not run: it parks its work
in Redis (`llmq:parked:{model}:{tenant}`, a sorted set: the broker priority, then first come first
served) and returns at once, so the worker's other threads stay free for whoever comes next, and
the queue does not hold the flood in front of them.

Parked work goes back to the broker when there is room for it: each time a task ends, its worker
sends the parked work of the tenant with the fewest threads for its weight that is under its limit;
and every heartbeat, a worker with idle threads sends what fits (a new worker, or a tenant whose
tasks all ended elsewhere). The database still says the work is queued, so the sweep sends it again
should Redis lose it; a second delivery is harmless, as ever. Celery-free: `send` is handed in.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis

from llmq.events import parked_count_key, parked_key, parked_tenants_key
from workers.work import Work

log = logging.getLogger(__name__)

# Park works in the order given, after everything the tenant parked before: a work's score is its
# priority * 10^15 plus its number in the tenant's count (an integer a double holds exactly for
# priorities up to 8).
# KEYS: the tenants set, the tenant's sorted set, its count. ARGV: the tenant, then the priority and
# the work of each.
_PARK = """
local last = redis.call('incrby', KEYS[3], (#ARGV - 1) / 2)
local first = last - (#ARGV - 1) / 2
for i = 2, #ARGV, 2 do
  redis.call('zadd', KEYS[2], string.format('%d', tonumber(ARGV[i]) * 1e15 + first + i / 2), ARGV[i + 1])
end
redis.call('sadd', KEYS[1], ARGV[1])
return last
"""

# Pop the first of the highest priority; forget the tenant once it has nothing parked.
_POP = """
local work = redis.call('zpopmin', KEYS[2])
if redis.call('zcard', KEYS[2]) == 0 then redis.call('srem', KEYS[1], ARGV[1]) end
return work[1]
"""


def _parked_tenants(client: redis.Redis, model: str) -> list[str]:
    return [t.decode() for t in client.smembers(parked_tenants_key(model))]


def parked_works(client: redis.Redis, model: str) -> set[tuple[str, str]]:
    """(task name, argument as text) of every work parked for the model, whoever's."""
    tenants = _parked_tenants(client, model)
    pipe = client.pipeline(transaction=False)
    for tenant in tenants:
        pipe.zrange(parked_key(model, tenant), 0, -1)
    works = (Work.decode(raw) for members in pipe.execute() for raw in members)
    return {(work.task, str(work.arg)) for work in works}


class TenantIntake:
    def __init__(self, client: redis.Redis, model: str, threads: int, tenant_threads: int,
                 weight: Callable[[str], float], send: Callable[[Work], None],
                 saturated: Callable[[], bool] = lambda: False):
        """`saturated`: whether the engine has more than it can run soon (workers/capacity.py); while it
        does, only a tenant with nothing running here starts a task, and the others' work is parked."""
        self.client, self.model = client, model
        self.threads, self.tenant_threads = threads, tenant_threads
        self.weight, self.send, self.saturated = weight, send, saturated
        self._in_flight: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._pop = client.register_script(_POP)
        self._park = client.register_script(_PARK)

    @contextmanager
    def turn(self, tenant: str, work: Work) -> Iterator[bool]:
        """True: run `work` now, in this thread (it counts against the tenant until the block ends,
        and then the next parked work is sent). False: the tenant is at its limit and `work` is parked."""
        if not self._enter(tenant):
            try:
                self.park(tenant, work)
            except redis.RedisError as err:  # nowhere to park: run it rather than lose it
                log.warning("could not park %s of tenant %s (%s); running it now", work.task, tenant, err)
                with self._lock:
                    self._in_flight[tenant] += 1
            else:
                yield False
                return
        try:
            yield True
        finally:
            with self._lock:
                self._in_flight[tenant] -= 1
                if not self._in_flight[tenant]:
                    del self._in_flight[tenant]
            self.resume(limit=1)

    def in_flight(self) -> dict[str, int]:
        with self._lock:
            return dict(self._in_flight)

    def park(self, tenant: str, *works: Work) -> None:
        """Park works of the tenant's, after all it has parked (a batch's lines in one round trip)."""
        if not works:
            return
        args = [tenant]
        for work in works:
            args += [work.priority, work.encode()]
        self._park(keys=[parked_tenants_key(self.model), parked_key(self.model, tenant),
                         parked_count_key(self.model, tenant)], args=args)

    def parked(self) -> dict[str, int]:
        """How much work each tenant has parked for this model."""
        tenants = sorted(_parked_tenants(self.client, self.model))
        pipe = self.client.pipeline(transaction=False)
        for tenant in tenants:
            pipe.zcard(parked_key(self.model, tenant))
        return {tenant: count for tenant, count in zip(tenants, pipe.execute()) if count}

    def resume(self, limit: int) -> int:
        """Send up to `limit` parked works back to the broker, no more than this worker has idle
        threads for: each to the tenant with the fewest threads here for its weight, of those under
        their limit. Returns how many were sent. Redis or the broker away: what could not be sent
        stays parked, and the next chance tries again."""
        sent = 0
        try:
            with self._lock:
                budget = min(limit, self.threads - sum(self._in_flight.values()))
                load = Counter(self._in_flight)
            # The tenants with work parked (a pop finds out when one has no more: no count is read first).
            parked = set(_parked_tenants(self.client, self.model)) if budget > 0 else set()
            while sent < budget:
                saturated = self.saturated()
                tenants = [t for t in parked if self._may_start(load[t], saturated)]
                if not tenants:
                    break
                tenant = min(tenants, key=lambda t: (load[t] / self.weight(t), t))
                raw = self._pop(keys=[parked_tenants_key(self.model), parked_key(self.model, tenant)], args=[tenant])
                if raw is None:  # nothing left (another worker took the rest)
                    parked.discard(tenant)
                    continue
                work = Work.decode(raw)
                try:
                    self.send(work)
                except Exception:
                    self.park(tenant, work)
                    raise
                load[tenant] += 1
                sent += 1
        except Exception as err:
            log.warning("could not send parked work back to the queue (%s); trying again later", err)
        return sent

    def resume_idle(self) -> int:
        """What a heartbeat sends: as much parked work as this worker has idle threads for."""
        return self.resume(limit=self.threads)  # resume() sends no more than the idle threads take

    def _may_start(self, in_flight: int, saturated: bool) -> bool:
        return in_flight < self.tenant_threads and (not saturated or in_flight == 0)

    def _enter(self, tenant: str) -> bool:
        saturated = self.saturated()
        with self._lock:
            if not self._may_start(self._in_flight[tenant], saturated):
                return False
            self._in_flight[tenant] += 1
            return True
