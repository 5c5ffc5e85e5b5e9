"""The sweep: what the database says must happen is made to happen, whatever the broker lost.

Every LLMQ_SWEEP_SECONDS one worker (whoever takes the `llmq:sweep` lock) runs `Sweeper.sweep`:
- batches past their completion window are expired, and their lines still running are cancelled;
- a dead worker's work is sent again: a worker whose heartbeats stopped for longer than a lease
  lasts (LLMQ_LEASE_SECONDS) has its held work (workers/held_work.py) sent to the queue, to resume
  from its checkpoints on a live worker, and its records are removed. The broker's own redelivery
  (the visibility timeout, an hour by default) comes much later, and finds the work done;
- work the broker lost is sent again. Redis is not a fully durable queue: a message that a consumer
  popped (BRPOP) while its connection died, before the reply arrived, is gone, since kombu records a
  delivered message only once it has it. The database still says the work is unfinished. A batch line
  or an API request that is unfinished, held by no worker and no lease, while its model's queue is
  empty, and not parked for its tenant's turn (workers/tenant_intake.py), for longer than a lease
  lasts, gets its task sent again.
A duplicate is harmless: tasks skip finished work, and a lease keeps two runs of one request apart.

Torch-free and Flask-free: it takes a database, a Redis client and the Celery app.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import redis
from celery import Celery
from sqlalchemy import select

from llmq import fleet
from llmq.events import WORKERS_KEY, held_key, lease_key
from llmq.settings import queue_name
from llmq.store import batch_lifecycle
from llmq.store.database import Database
from llmq.store.models import UNFINISHED_ITEM_STATES, Batch, BatchItem, BatchStatus, Request, RequestStatus
from llmq.streams import request_cancel
from workers.held_work import held_keys, holders, read_held
from workers.tenant_intake import parked_works

log = logging.getLogger(__name__)


@dataclass
class SweepResult:
    expired_batches: list[str] = field(default_factory=list)
    taken_over: list[str] = field(default_factory=list)  # "<task>:<arg>" of dead workers' held work, sent again
    resent: list[str] = field(default_factory=list)  # "llmq.run_batch_item:<item id>" or "llmq.complete:<request id>"


class Sweeper:
    def __init__(self, db: Database, client: redis.Redis, celery_app: Celery, lease_seconds: float, stream_ttl: int):
        self.db, self.client, self.celery_app = db, client, celery_app
        self.lease_seconds, self.stream_ttl = lease_seconds, stream_ttl
        self._unseen_since: dict[tuple[str, str], float] = {}  # (task name, id) -> first seen orphaned

    def sweep(self, now: float) -> SweepResult:
        result = SweepResult()
        with self.db.session() as session:
            expired = batch_lifecycle.expire_overdue(session, now)
        for batch_id, running in expired:
            result.expired_batches.append(batch_id)
            for request_id in running:
                request_cancel(self.client, request_id, self.stream_ttl)
        result.taken_over = self._take_over_dead_workers(now)
        candidates = self._orphan_candidates()
        for key in list(self._unseen_since):
            if key not in candidates:
                del self._unseen_since[key]
        for key, (model, priority) in candidates.items():
            since = self._unseen_since.setdefault(key, now)
            if now - since > self.lease_seconds:
                task_name, task_id = key
                arg = int(task_id) if task_name == "llmq.run_batch_item" else task_id
                self.celery_app.send_task(task_name, args=[arg], queue=queue_name(model), priority=priority)
                self._unseen_since[key] = now
                result.resent.append(f"{task_name}:{task_id}")
        if result.resent:
            log.warning("sent again %d task(s) the broker lost: %s", len(result.resent), ", ".join(result.resent[:10]))
        return result

    def _take_over_dead_workers(self, now: float) -> list[str]:
        """Send the held work of every worker run whose heartbeats stopped a lease ago to the queue again."""
        alive = fleet.live_instances(self.client, self.lease_seconds, now)
        sent = []
        for instance in holders(self.client):
            if instance in alive:
                continue
            entries = read_held(self.client, instance)
            for entry in entries:
                self.celery_app.send_task(entry.work.task, args=[entry.work.arg], queue=entry.queue,
                                          priority=entry.work.priority)
                sent.append(entry.work.key)
            self.client.delete(held_key(instance))
            if entries:
                log.warning("worker %s sent no heartbeat for over %d s: its %d task(s) go to the queue again, to "
                            "resume from their checkpoints: %s", instance, self.lease_seconds, len(entries),
                            ", ".join(e.work.key for e in entries[:10]))
        for name, beat in fleet.heartbeats(self.client).items():  # what GET /v1/workers no longer shows anyway
            if not fleet.is_alive(beat, now, self.lease_seconds):
                self.client.hdel(WORKERS_KEY, name)
        return sent

    def _orphan_candidates(self) -> dict[tuple[str, str], tuple[str, int]]:
        """Unfinished work of the models whose queue is empty, held by no worker and no lease: (task, id)
        -> (model, broker priority)."""
        with self.db.read() as session:
            batch_models = set(session.scalars(select(Batch.model).where(Batch.status == BatchStatus.IN_PROGRESS).distinct()))
            request_models = set(session.scalars(select(Request.model).where(
                Request.status.in_((RequestStatus.QUEUED, RequestStatus.RUNNING)), Request.batch_id.is_(None)).distinct()))
        idle_models = {model for model in batch_models | request_models if self._queue_size(model) == 0}
        if not idle_models:
            return {}
        candidates: dict[tuple[str, str], tuple[str, int]] = {}
        with self.db.read() as session:
            items = session.execute(select(BatchItem.id, BatchItem.request_id, Batch.model, Batch.id)
                                    .join(Batch, Batch.id == BatchItem.batch_id)
                                    .where(Batch.status == BatchStatus.IN_PROGRESS, Batch.model.in_(idle_models),
                                           BatchItem.status.in_(UNFINISHED_ITEM_STATES))).all()
            requests = session.execute(select(Request.id, Request.model).where(
                Request.status.in_((RequestStatus.QUEUED, RequestStatus.RUNNING)), Request.batch_id.is_(None),
                Request.model.in_(idle_models))).all()
        held = held_keys(self.client)  # a batch being expanded has lines not yet parked: not orphans
        work = [(("llmq.run_batch_item", str(item_id)), request_id, model, batch_lifecycle.BATCH_BROKER_PRIORITY)
                for item_id, request_id, model, batch_id in items if f"llmq.run_batch:{batch_id}" not in held]
        work += [(("llmq.complete", request_id), request_id, model, 0) for request_id, model in requests]
        leased = self._leased([request_id for _, request_id, _, _ in work if request_id])
        parked = set().union(*(parked_works(self.client, model) for model in idle_models))
        for key, request_id, model, priority in work:
            if request_id not in leased and key not in parked and ":".join(key) not in held:
                candidates[key] = (model, priority)
        return candidates

    def _leased(self, request_ids: list[str]) -> set[str]:
        if not request_ids:
            return set()
        pipe = self.client.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.exists(lease_key(request_id))
        return {request_id for request_id, held in zip(request_ids, pipe.execute()) if held}

    def _queue_size(self, model: str) -> int:
        """Messages waiting in the model's queue, every priority level together."""
        with self.celery_app.connection_for_read() as connection:
            try:
                return connection.default_channel.queue_declare(queue=queue_name(model), passive=True).message_count
            except connection.channel_errors:  # Redis keeps no empty lists: no queue is an empty queue
                return 0
