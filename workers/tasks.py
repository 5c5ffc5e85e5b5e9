"""Celery tasks: thin, they take ids and call the engine service and the batch bookkeeping.

Every task is safe to run twice (late acknowledgement redelivers a crashed worker's tasks): the
database says what is already done, the request's lease (workers/leases.py) keeps a second delivery
from running it while the first still does, and the request's stream is its checkpoint, so a
request taken over from a dead or stopping worker goes on from the tokens it had already streamed.
A worker that is stopping hands its requests back: the task is rejected and requeued.
"""
from __future__ import annotations

import logging
import time

from celery import shared_task
from celery.exceptions import Reject
from flask import current_app

from app.config import queue_name
from app.models import Batch, BatchItem, Request, new_id
from app.streams import StreamProgress, is_cancelled, read_progress
from workers import batch_lifecycle
from workers.completion_runner import execute
from workers.engine.config import InvalidRequest
from workers.leases import Leases
from workers.service import EngineFailure, HandedBack, current_service

log = logging.getLogger(__name__)

TERMINAL = ("completed", "failed", "cancelled")
# Batch lines also enter the engine after API requests (see batch_lifecycle.BATCH_BROKER_PRIORITY).
API_ENGINE_PRIORITY, BATCH_ENGINE_PRIORITY = 0, 1


def _db():
    return current_app.extensions["llmq_db"]


def _redis():
    return current_app.extensions["llmq_redis"]


def _leases() -> Leases:
    return current_app.extensions["llmq_leases"]


def _checkpoint(request_id: str) -> StreamProgress | None:
    """What an interrupted earlier run of this request streamed (None for a first run)."""
    progress = read_progress(_redis(), request_id)
    return progress if progress.choices or progress.ended_with else None


def _request_finished(request_id: str) -> bool:
    with _db().read() as session:
        request = session.get(Request, request_id)
        return request is None or request.status in TERMINAL


def _item_finished(item_id: int) -> bool:
    with _db().read() as session:
        item = session.get(BatchItem, item_id)
        return item is None or item.status in batch_lifecycle.TERMINAL_ITEM_STATES


def _error_code(err: Exception) -> str:
    if isinstance(err, InvalidRequest):
        return "invalid_request"
    if not isinstance(err, EngineFailure):
        log.exception("request failed unexpectedly")
    return "server_error"


@shared_task(name="llmq.complete")
def complete(request_id: str) -> str:
    """Run one API request (completion or chat) and store its result."""
    db, service = _db(), current_service()
    with db.session() as session:
        request = session.get(Request, request_id)
        if request is None or request.status in TERMINAL:
            return "skipped"
        if is_cancelled(_redis(), request_id):
            request.status, request.finished_at = "cancelled", time.time()
            service.publisher.publish_one(request_id, service.publisher.error_event(
                "cancelled", "the request was cancelled before it started", time.time()), finished=True)
            return "cancelled"
        kind, body, model, created = request.kind, request.body, request.model, int(request.created_at)
    if not _leases().acquire_when_free(request_id, lambda: _request_finished(request_id)):
        return "skipped"
    try:
        return _complete_leased(service, request_id, kind, body, model, created)
    finally:
        _leases().release(request_id)


def _complete_leased(service, request_id: str, kind: str, body: dict, model: str, created: int) -> str:
    db = _db()
    checkpoint = _checkpoint(request_id)
    with db.session() as session:
        request = session.get(Request, request_id)
        if checkpoint is not None and checkpoint.ended_with and checkpoint.ended_with["type"] == "error":
            # It failed, and its worker died before writing that down: its readers saw the error already.
            request.status, request.finished_at, request.error = "failed", time.time(), checkpoint.ended_with["error"]
            return "failed"
        request.status, request.started_at = "running", request.started_at or time.time()
    try:
        response, job = execute(service, request_id, kind, body, model, created, resume_from=checkpoint,
                                priority=API_ENGINE_PRIORITY)
    except HandedBack:
        with db.session() as session:
            session.get(Request, request_id).status = "queued"
        raise Reject("the worker is stopping; requeued to resume elsewhere", requeue=True) from None
    except Exception as err:  # every failure ends the request, so no client waits on its stream forever
        code = _error_code(err)
        event = service.publisher.error_event(code, str(err), time.time(), getattr(err, "param", None))
        service.publisher.publish_one(request_id, event, finished=True)
        with db.session() as session:
            request = session.get(Request, request_id)
            request.status, request.finished_at = "failed", time.time()
            request.error = {"code": code, "message": str(err), "param": getattr(err, "param", None)}
        return "failed"
    with db.session() as session:
        request = session.get(Request, request_id)
        request.status = "cancelled" if job.cancelled else "completed"
        request.response = response
        request.prompt_tokens, request.completion_tokens = job.prompt_tokens, job.completion_tokens
        request.first_token_at, request.finished_at = job.first_token_at, time.time()
    return request.status


@shared_task(name="llmq.run_batch")
def run_batch(batch_id: str) -> int:
    """Validate a batch's input file and fan its lines out as one task each."""
    settings = current_app.config["LLMQ"]
    with _db().session() as session:
        batch = session.get(Batch, batch_id)
        if batch is None:
            return 0
        if batch.status == "validating":
            item_ids = batch_lifecycle.expand_input(session, batch, batch.model, settings.max_batch_lines)
        else:  # a redelivery: send again what has not run (items run at most once, see run_batch_item)
            item_ids = [i.id for i in batch_lifecycle.pending_items(session, batch_id)]
        queue = queue_name(batch.model)
    for item_id in item_ids:
        run_batch_item.apply_async(args=[item_id], queue=queue, priority=batch_lifecycle.BATCH_BROKER_PRIORITY)
    with _db().session() as session:
        batch_lifecycle.finalize_if_done(session, batch_id)
    log.info("batch %s: %d lines queued", batch_id, len(item_ids))
    return len(item_ids)


@shared_task(name="llmq.run_batch_item")
def run_batch_item(item_id: int) -> str:
    """One line of a batch: run it, then write its result and the batch's counts in one transaction."""
    db, service = _db(), current_service()
    with db.session() as session:
        claimed = batch_lifecycle.claim_item(session, item_id, new_id("cmpl-"))
        if claimed is None:  # done already, or its batch is being cancelled: it may be the last line
            item = session.get(BatchItem, item_id)
            if item is not None:
                batch_lifecycle.finalize_if_done(session, item.batch_id)
            batch_id = None
        else:
            item, batch = claimed
            batch_id, request_id = batch.id, item.request_id
            body, custom_id, endpoint, model = item.body, item.custom_id, batch.endpoint, batch.model
    if batch_id is None:
        return "skipped"
    if not _leases().acquire_when_free(request_id, lambda: _item_finished(item_id)):
        return "skipped"
    try:
        return _run_item_leased(service, item_id, batch_id, request_id, body, custom_id, endpoint, model)
    finally:
        _leases().release(request_id)


def _run_item_leased(service, item_id: int, batch_id: str, request_id: str, body: dict, custom_id: str,
                     endpoint: str, model: str) -> str:
    db = _db()
    kind = "chat" if endpoint.endswith("/chat/completions") else "completion"
    try:
        response, job = execute(service, request_id, kind, body, model, resume_from=_checkpoint(request_id),
                                priority=BATCH_ENGINE_PRIORITY)
        status = "cancelled" if job.cancelled else "completed"
        line = batch_lifecycle.success_line(custom_id, response) if status == "completed" else None
    except HandedBack:
        raise Reject("the worker is stopping; requeued to resume elsewhere", requeue=True) from None
    except Exception as err:  # one line's failure is one error line, never a stuck batch
        status = "failed"
        code = _error_code(err)
        with db.session() as session:
            line = batch_lifecycle.error_line(session.get(BatchItem, item_id), code, str(err))
    with db.session() as session:
        batch_lifecycle.record_result(session, item_id, status, line)
    with db.session() as session:
        batch_lifecycle.finalize_if_done(session, batch_id)
    return status
