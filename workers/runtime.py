"""WorkerRuntime: what a worker's tasks use, built once when the worker starts and passed to them."""
from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass

import redis

from llmq import fleet
from llmq.protocol.prepare import ServedModel
from llmq.settings import Settings
from llmq.store.database import Database
from workers.capacity import Admission
from workers.engine_client import EngineClient
from workers.held_work import HeldWork
from workers.leases import Leases
from workers.publisher import StreamPublisher
from workers.tenant_intake import TenantIntake


@dataclass(frozen=True)
class WorkerRuntime:
    settings: Settings  # bootstrapped: redis_url and model_path are set
    db: Database
    redis: redis.Redis
    publisher: StreamPublisher  # for the events the task threads write themselves (a request's end)
    engine: EngineClient
    model: ServedModel  # what batch lines are prepared for
    leases: Leases
    intake: TenantIntake  # how many task threads each tenant holds, and its work parked for later
    name: str  # the worker's Celery hostname, its heartbeat's key
    instance: str  # this run of the worker: what its heartbeats, leases and held work name (llmq/fleet.py)
    held: HeldWork  # the tasks it runs now, for the sweep to send again should it die
    admission: Admission  # whether its engine is saturated, as the capacity gate last saw it
    background: Executor  # bookkeeping that need not hold up a request (its row marked running)

    def is_alive(self, instance: str) -> bool:
        """Whether the worker run `instance` sends heartbeats (fresher than a lease lasts)."""
        return instance in fleet.live_instances(self.redis, self.settings.lease_seconds)
