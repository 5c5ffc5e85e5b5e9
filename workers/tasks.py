"""Celery tasks: thin, they take ids and call the engine and the batch bookkeeping with the worker's
runtime (workers/runtime.py), which their task class hands them.

Every task is safe to run twice (the sweep sends a dead worker's held work again, and late
acknowledgement redelivers it too, later): the database says what is already done, the request's
lease (workers/leases.py) keeps a second delivery from running it while a live worker does, and the
request's stream is its checkpoint, so a request taken over from a dead or stopping worker goes on
from the tokens it had already streamed. Each task is in its worker's held work while it runs
(workers/held_work.py).
A worker that is stopping hands its requests back: the task is rejected and requeued. A tenant
holding its share of the worker's threads has its task's work parked for later (returns "parked",
see workers/tenant_intake.py), so the other tenants' tasks find a thread.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import redis
from celery import Task, shared_task
from celery.exceptions import Reject
from sqlalchemy import func, update

from llmq.errors import InvalidRequest
from llmq.events import ErrorEvent, StreamProgress
from llmq.protocol.openai import batch_error_line, new_id
from llmq.protocol.prepare import CHAT, COMPLETION, PreparedRequest, prepare
from llmq.settings import queue_name
from llmq.store import batch_lifecycle
from llmq.store.models import (
    TERMINAL_ITEM_STATES,
    TERMINAL_REQUEST_STATES,
    Batch,
    BatchItem,
    BatchStatus,
    File,
    ItemStatus,
    Request,
    RequestStatus,
)
from llmq.streams import is_cancelled, read_progress
from workers.completion_runner import execute
from workers.messages import EngineFailure, EngineResult, HandedBack, StreamWriteFailure
from workers.runtime import WorkerRuntime
from workers.work import Work

log = logging.getLogger(__name__)

# Batch lines also enter the engine after API requests (see batch_lifecycle.BATCH_BROKER_PRIORITY).
API_ENGINE_PRIORITY, BATCH_ENGINE_PRIORITY = 0, 1


class RuntimeTask(Task):
    """Celery's documented pattern for what tasks share (a custom task class): the worker's runtime,
    built once when the worker starts (workers/celery_app.py)."""

    @property
    def runtime(self) -> WorkerRuntime:
        runtime = getattr(self.app, "runtime", None)
        if runtime is None:
            raise RuntimeError("no engine in this process: tasks run in an llmq worker (see workers/celery_app.py)")
        return runtime

    def holding(self, arg: str | int):
        """This delivery, in the worker's held work while it runs (workers/held_work.py)."""
        priority = (self.request.delivery_info or {}).get("priority") or 0
        return self.runtime.held.holding(Work(self.name, arg, priority))


@shared_task(name="llmq.complete", bind=True, base=RuntimeTask)
def complete(self: RuntimeTask, request_id: str) -> str:
    """Run one API request (completion or chat) and store its result."""
    with self.holding(request_id):
        return complete_request(self.runtime, request_id)


@shared_task(name="llmq.run_batch", bind=True, base=RuntimeTask)
def run_batch(self: RuntimeTask, batch_id: str) -> int:
    """Validate a batch's input file and fan its lines out as one task each."""
    with self.holding(batch_id):
        return expand_batch(self.runtime, batch_id)


@shared_task(name="llmq.run_batch_item", bind=True, base=RuntimeTask)
def run_batch_item(self: RuntimeTask, item_id: int) -> str:
    """One line of a batch: run it, then write its result and the batch's counts in one transaction."""
    with self.holding(item_id):
        return run_item(self.runtime, item_id)


# ---- API requests ------------------------------------------------------------------------------

def complete_request(runtime: WorkerRuntime, request_id: str) -> str:
    with runtime.db.read() as session:  # a write transaction would wait for every other writer first
        request = session.get(Request, request_id)
        if request is None or request.status in TERMINAL_REQUEST_STATES:
            return "skipped"
        kind, body, prepared, model = request.kind, request.body, request.prepared, request.model
        created, tenant = int(request.created_at), request.tenant
    if _before_start(runtime, request_id, lambda: is_cancelled(runtime.redis, request_id)):
        return _cancel_before_start(runtime, request_id)
    with runtime.intake.turn(tenant, Work("llmq.complete", request_id)) as now:
        if not now:
            return "parked"
        if not _take_lease(runtime, request_id, lambda: _request_finished(runtime, request_id)):
            return "skipped"
        try:
            return _complete_leased(runtime, request_id, _prepared(runtime, kind, body, prepared), model, created,
                                    tenant)
        except InvalidRequest as err:  # a row stored before requests were prepared at intake, refused now
            return _fail_request(runtime, request_id, err)
        finally:
            runtime.leases.release(request_id)


def _mark_running(runtime: WorkerRuntime, request_id: str, at: float) -> None:
    """queued -> running, unless the request has moved on meanwhile (it may even have finished)."""
    try:
        with runtime.db.session() as session:
            session.execute(update(Request).where(Request.id == request_id, Request.status == RequestStatus.QUEUED)
                            .values(status=RequestStatus.RUNNING, started_at=func.coalesce(Request.started_at, at)))
    except Exception:
        log.exception("could not mark request %s running", request_id)


def _cancel_before_start(runtime: WorkerRuntime, request_id: str) -> str:
    with runtime.db.session() as session:
        request = session.get(Request, request_id)
        if request.status in TERMINAL_REQUEST_STATES:
            return "skipped"
        request.status, request.finished_at = RequestStatus.CANCELLED, time.time()
    runtime.publisher.publish_one(request_id, ErrorEvent(
        "cancelled", "the request was cancelled before it started", t=time.time()), finished=True)
    return RequestStatus.CANCELLED


def _complete_leased(runtime: WorkerRuntime, request_id: str, prepared: PreparedRequest, model: str,
                     created: int, tenant: str) -> str:
    checkpoint = _before_start(runtime, request_id, lambda: _checkpoint(runtime, request_id))
    if checkpoint is not None and checkpoint.error is not None:
        # It failed, and its worker died before writing that down: its readers saw the error already.
        with runtime.db.session() as session:
            request = session.get(Request, request_id)
            request.status, request.finished_at = RequestStatus.FAILED, time.time()
            request.error = checkpoint.error.as_dict()
        return RequestStatus.FAILED
    # Written beside the run, not before it: a write waits its turn behind the worker's other writes
    # (on SQLite, all of them), and the first token need not wait for the row to say "running".
    runtime.background.submit(_mark_running, runtime, request_id, time.time())
    try:
        response, result = _execute(runtime, request_id, prepared, model, created, checkpoint, API_ENGINE_PRIORITY,
                                    tenant)
    except HandedBack:
        with runtime.db.session() as session:
            session.get(Request, request_id).status = RequestStatus.QUEUED
        raise Reject("the worker is stopping; requeued to resume elsewhere", requeue=True) from None
    except REDIS_AWAY as err:
        _requeue_after_outage(runtime, request_id, err)
        return _fail_request(runtime, request_id, err)
    except Exception as err:  # every failure ends the request, so no client waits on its stream forever
        return _fail_request(runtime, request_id, err)
    with runtime.db.session() as session:
        request = session.get(Request, request_id)
        request.status = RequestStatus.CANCELLED if result.cancelled else RequestStatus.COMPLETED
        request.response = response
        request.prompt_tokens, request.completion_tokens = result.prompt_tokens, result.completion_tokens
        request.first_token_at, request.finished_at = result.first_token_at, time.time()
    return request.status


def _fail_request(runtime: WorkerRuntime, request_id: str, err: Exception) -> str:
    """End a request with `err`: its stream's last event says so, and so does its row."""
    event = ErrorEvent(_error_code(err), str(err), getattr(err, "param", None), time.time())
    runtime.publisher.publish_one(request_id, event, finished=True)
    with runtime.db.session() as session:
        request = session.get(Request, request_id)
        request.status, request.finished_at, request.error = RequestStatus.FAILED, time.time(), event.as_dict()
    return RequestStatus.FAILED


# ---- batches -----------------------------------------------------------------------------------

def expand_batch(runtime: WorkerRuntime, batch_id: str) -> int:
    with runtime.db.read() as session:
        batch = session.get(Batch, batch_id)
        if batch is None:
            return 0
        content = session.get(File, batch.input_file_id).content if batch.status == BatchStatus.VALIDATING else None
        if content is None:  # a redelivery: send again what has not run (items run at most once, see run_item)
            item_ids = [i.id for i in batch_lifecycle.pending_items(session, batch_id)]
        queue, tenant = queue_name(batch.model), batch.tenant
    if content is not None:  # parsed and tokenized before the transaction that stores it
        items = batch_lifecycle.read_input(batch, content, runtime.model, runtime.engine.tokenizer,
                                           runtime.settings.max_batch_lines)
        with runtime.db.session() as session:
            item_ids = batch_lifecycle.store_input(session, batch_id, items)
    _queue_lines(runtime, tenant, queue, item_ids)
    _finalize_if_done(runtime, batch_id)
    log.info("batch %s: %d lines queued", batch_id, len(item_ids))
    return len(item_ids)


def _queue_lines(runtime: WorkerRuntime, tenant: str, queue: str, item_ids: list[int]) -> None:
    """A batch's lines wait for their tenant's turn parked, in order, and go to the broker as the
    workers have threads for them (workers/tenant_intake.py): sent all at once, a large batch's lines
    would each take a thread only to be parked, in front of every other tenant's work."""
    works = [Work("llmq.run_batch_item", item_id, batch_lifecycle.BATCH_BROKER_PRIORITY) for item_id in item_ids]
    try:
        for start in range(0, len(works), 1000):
            runtime.intake.park(tenant, *works[start:start + 1000])
    except redis.RedisError as err:
        log.warning("could not park the lines of tenant %s (%s); sending them to the broker", tenant, err)
        for work in works:
            run_batch_item.apply_async(args=[work.arg], queue=queue, priority=work.priority)
        return
    runtime.intake.resume_idle()


def run_item(runtime: WorkerRuntime, item_id: int) -> str:
    with runtime.db.session() as session:
        claimed = batch_lifecycle.claim_item(session, item_id, new_id("cmpl-"))
        if claimed is None:  # done already, or its batch is being cancelled: it may be the last line
            item = session.get(BatchItem, item_id)
            if item is not None:
                batch_lifecycle.finalize_if_done(session, item.batch_id)
            return "skipped"
        item, batch = claimed
        line = _BatchLine(item_id, batch.id, batch.tenant, item.request_id, item.custom_id, item.line, batch.model,
                          CHAT if batch.endpoint.endswith("/chat/completions") else COMPLETION, item.body,
                          item.prepared)
    work = Work("llmq.run_batch_item", item_id, batch_lifecycle.BATCH_BROKER_PRIORITY)
    with runtime.intake.turn(line.tenant, work) as now:
        if not now:
            return "parked"  # claimed (running, in the database), to run when its tenant has a thread
        if not _take_lease(runtime, line.request_id, lambda: _item_finished(runtime, item_id)):
            return "skipped"
        try:
            return _run_item_leased(runtime, line)
        finally:
            runtime.leases.release(line.request_id)


@dataclass(frozen=True)
class _BatchLine:
    """What running one claimed batch line needs, read in the claiming transaction."""

    item_id: int
    batch_id: str
    tenant: str
    request_id: str
    custom_id: str
    line: int
    model: str
    kind: str
    body: dict
    prepared: dict | None


def _run_item_leased(runtime: WorkerRuntime, line: _BatchLine) -> str:
    try:
        prepared = _prepared(runtime, line.kind, line.body, line.prepared)
        response, result = _execute(runtime, line.request_id, prepared, line.model, None,
                                    _checkpoint(runtime, line.request_id), BATCH_ENGINE_PRIORITY, line.tenant)
        status = ItemStatus.CANCELLED if result.cancelled else ItemStatus.COMPLETED
        output = batch_lifecycle.success_line(line.custom_id, response) if status == ItemStatus.COMPLETED else None
    except HandedBack:
        raise Reject("the worker is stopping; requeued to resume elsewhere", requeue=True) from None
    except REDIS_AWAY as err:
        _requeue_after_outage(runtime, line.request_id, err)
        status = ItemStatus.FAILED  # Redis did not come back within LLMQ_REDIS_OUTAGE_SECONDS
        output = batch_error_line(line.custom_id, "server_error", f"Redis was unavailable: {err}", line.line)
    except Exception as err:  # one line's failure is one error line, never a stuck batch
        status = ItemStatus.FAILED
        output = batch_error_line(line.custom_id, _error_code(err), str(err), line.line)
    with runtime.db.session() as session:
        batch_lifecycle.record_result(session, line.item_id, status, output)
    _finalize_if_done(runtime, line.batch_id)
    return status


def _finalize_if_done(runtime: WorkerRuntime, batch_id: str) -> None:
    """End the batch if no line is left to run. Asked by every line as it ends, after its own result
    is committed (so the last line's question sees every result): a read, and a write transaction
    (which waits for every other writer on SQLite) only for the batch that is done."""
    with runtime.db.read() as session:
        if batch_lifecycle.has_unfinished_items(session, batch_id):
            return
    with runtime.db.session() as session:
        batch_lifecycle.finalize_if_done(session, batch_id)


# ---- shared ------------------------------------------------------------------------------------

REDIS_OUTAGE_RETRIES = 3  # runs of one request that Redis going away may cut short before it fails
REDIS_AWAY = (redis.ConnectionError, redis.TimeoutError)  # BusyLoadingError (still loading) among them
T = TypeVar("T")


def _before_start(runtime: WorkerRuntime, request_id: str, call: Callable[[], T]) -> T:
    """call(), which reads or writes Redis before the request's run starts (its cancel flag, its lease, its
    checkpoint). Redis being away then is no fault of the request's: once Redis answers, the task goes back
    to the queue (_requeue_after_outage); the error goes on only if Redis stays away past
    LLMQ_REDIS_OUTAGE_SECONDS."""
    try:
        return call()
    except REDIS_AWAY as err:
        _requeue_after_outage(runtime, request_id, err)
        raise


def _take_lease(runtime: WorkerRuntime, request_id: str, finished: Callable[[], bool]) -> bool:
    """The request's lease (Leases.acquire_unless_alive), taken before its run starts (_before_start)."""
    return _before_start(runtime, request_id,
                         lambda: runtime.leases.acquire_unless_alive(request_id, finished, runtime.is_alive))


def _requeue_after_outage(runtime: WorkerRuntime, request_id: str, err: Exception) -> None:
    """A run that Redis being away stopped before it could start (_before_start) is no fault
    of the request's: once Redis answers, the task goes back to the queue and runs from its checkpoint.
    Returns only if Redis stays away past LLMQ_REDIS_OUTAGE_SECONDS: then the request fails."""
    if _redis_answers(runtime, runtime.settings.redis_outage_seconds):
        log.warning("request %s could not start: Redis was away (%s); Redis is back, so its task goes back to "
                    "the queue", request_id, err)
        raise Reject("Redis was away; requeued to run from its checkpoint", requeue=True) from None


def _execute(runtime: WorkerRuntime, request_id: str, prepared: PreparedRequest, model: str, created: int | None,
             checkpoint: StreamProgress | None, priority: int, tenant: str) -> tuple[dict, EngineResult]:
    """execute(); a run cut short because Redis was away past the client's retry window (its tokens
    could not be written) goes on from the request's checkpoint once Redis answers again: the outage
    was the only fault. At most REDIS_OUTAGE_RETRIES times, each within LLMQ_REDIS_OUTAGE_SECONDS."""
    retries = 0
    while True:
        try:
            return execute(runtime.engine, request_id, prepared, model, created, resume_from=checkpoint,
                           priority=priority, tenant=tenant, weight=runtime.settings.tenant_weight(tenant))
        except StreamWriteFailure as err:
            retries += 1
            if retries > REDIS_OUTAGE_RETRIES or not _redis_answers(runtime, runtime.settings.redis_outage_seconds):
                raise
            log.warning("request %s: its tokens could not be written (%s); Redis is back, so it goes on from its "
                        "checkpoint", request_id, err)
            checkpoint = _checkpoint(runtime, request_id)


def _redis_answers(runtime: WorkerRuntime, within_s: float) -> bool:
    """Whether Redis answers again within `within_s` seconds (asked about once a second)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if runtime.redis.ping():
                return True
        except redis.RedisError:
            pass
        time.sleep(1.0)
    return False


def _prepared(runtime: WorkerRuntime, kind: str, body: dict, stored: dict | None) -> PreparedRequest:
    """The request as prepared at intake; a row stored before intake prepared requests (migration
    0004) is prepared here, by the same code."""
    if stored is not None:
        return PreparedRequest.from_json(stored)
    return prepare(kind, body, runtime.engine.tokenizer, runtime.model)


def _checkpoint(runtime: WorkerRuntime, request_id: str) -> StreamProgress | None:
    """What an interrupted earlier run of this request streamed (None for a first run)."""
    progress = read_progress(runtime.redis, request_id)
    return progress if progress.choices or progress.ended_with else None


def _request_finished(runtime: WorkerRuntime, request_id: str) -> bool:
    with runtime.db.read() as session:
        request = session.get(Request, request_id)
        return request is None or request.status in TERMINAL_REQUEST_STATES


def _item_finished(runtime: WorkerRuntime, item_id: int) -> bool:
    with runtime.db.read() as session:
        item = session.get(BatchItem, item_id)
        return item is None or item.status in TERMINAL_ITEM_STATES


def _error_code(err: Exception) -> str:
    if isinstance(err, InvalidRequest):
        return err.code
    if not isinstance(err, EngineFailure):
        log.exception("request failed unexpectedly")
    return "server_error"
