"""The sweep: what the database says must happen is made to happen, whatever the broker lost.

Every LLMQ_SWEEP_SECONDS one worker (whoever takes the `llmq:sweep` lock) runs `Sweeper.sweep`:
- batches past their completion window are expired, and their lines still running are cancelled;
- work the broker lost is sent again. Redis is not a fully durable queue: a message that a consumer
  popped (BRPOP) while its connection died, before the reply arrived, is gone, since kombu records a
  delivered message only once it has it. The database still says the work is unfinished. A batch line
  or an API request that is unfinished, held by no lease, while its model's queue is empty, for
  longer than the visibility timeout (the time the broker takes to redeliver a dead worker's tasks
  itself), and not parked for its tenant's turn (workers/tenant_intake.py), gets its task sent again. A duplicate is harmless: tasks skip finished work, and a lease
  keeps two runs of one request apart.

Torch-free and Flask-free: it takes a database, a Redis client and the Celery app.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import redis
from celery import Celery
from sqlalchemy import select

from llmq.events import lease_key
from llmq.settings import queue_name
from llmq.store import batch_lifecycle
from llmq.store.database import Database
from llmq.store.models import UNFINISHED_ITEM_STATES, Batch, BatchItem, BatchStatus, Request, RequestStatus
from llmq.streams import request_cancel
from workers.tenant_intake import parked_works

log = logging.getLogger(__name__)


@dataclass
class SweepResult:
    expired_batches: list[str] = field(default_factory=list)
    resent: list[str] = field(default_factory=list)  # "llmq.run_batch_item:<item id>" or "llmq.complete:<request id>"


class Sweeper:
    def __init__(self, db: Database, client: redis.Redis, celery_app: Celery, visibility_timeout: float,
                 stream_ttl: int):
        self.db, self.client, self.celery_app = db, client, celery_app
        self.visibility_timeout, self.stream_ttl = visibility_timeout, stream_ttl
        self._unseen_since: dict[tuple[str, str], float] = {}  # (task name, id) -> first seen orphaned

    def sweep(self, now: float) -> SweepResult:
        result = SweepResult()
        with self.db.session() as session:
            expired = batch_lifecycle.expire_overdue(session, now)
        for batch_id, running in expired:
            result.expired_batches.append(batch_id)
            for request_id in running:
                request_cancel(self.client, request_id, self.stream_ttl)
        candidates = self._orphan_candidates()
        for key in list(self._unseen_since):
            if key not in candidates:
                del self._unseen_since[key]
        for key, (model, priority) in candidates.items():
            since = self._unseen_since.setdefault(key, now)
            if now - since > self.visibility_timeout:
                task_name, task_id = key
                arg = int(task_id) if task_name == "llmq.run_batch_item" else task_id
                self.celery_app.send_task(task_name, args=[arg], queue=queue_name(model), priority=priority)
                self._unseen_since[key] = now
                result.resent.append(f"{task_name}:{task_id}")
        if result.resent:
            log.warning("sent again %d task(s) the broker lost: %s", len(result.resent), ", ".join(result.resent[:10]))
        return result

    def _orphan_candidates(self) -> dict[tuple[str, str], tuple[str, int]]:
        """Unfinished work of the models whose queue is empty, held by no lease: (task, id) -> (model,
        broker priority)."""
        with self.db.read() as session:
            batch_models = set(session.scalars(select(Batch.model).where(Batch.status == BatchStatus.IN_PROGRESS).distinct()))
            request_models = set(session.scalars(select(Request.model).where(
                Request.status.in_((RequestStatus.QUEUED, RequestStatus.RUNNING)), Request.batch_id.is_(None)).distinct()))
        idle_models = {model for model in batch_models | request_models if self._queue_size(model) == 0}
        if not idle_models:
            return {}
        candidates: dict[tuple[str, str], tuple[str, int]] = {}
        with self.db.read() as session:
            items = session.execute(select(BatchItem.id, BatchItem.request_id, Batch.model)
                                    .join(Batch, Batch.id == BatchItem.batch_id)
                                    .where(Batch.status == BatchStatus.IN_PROGRESS, Batch.model.in_(idle_models),
                                           BatchItem.status.in_(UNFINISHED_ITEM_STATES))).all()
            requests = session.execute(select(Request.id, Request.model).where(
                Request.status.in_((RequestStatus.QUEUED, RequestStatus.RUNNING)), Request.batch_id.is_(None),
                Request.model.in_(idle_models))).all()
        work = [(("llmq.run_batch_item", str(item_id)), request_id, model, batch_lifecycle.BATCH_BROKER_PRIORITY)
                for item_id, request_id, model in items]
        work += [(("llmq.complete", request_id), request_id, model, 0) for request_id, model in requests]
        leased = self._leased([request_id for _, request_id, _, _ in work if request_id])
        parked = set().union(*(parked_works(self.client, model) for model in idle_models))
        for key, request_id, model, priority in work:
            if request_id not in leased and key not in parked:
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
