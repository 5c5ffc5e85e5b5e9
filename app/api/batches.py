"""The OpenAI Batch API: create a batch from an uploaded file, get one, list them, cancel one.

The web process writes the batch row and queues "llmq.run_batch"; a worker validates the input file
and fans its lines out (workers.tasks), so a large file never holds up an HTTP request. Cancelling is
bookkeeping here plus a cancel flag per running line, which workers act on at their next engine step.
"""
from __future__ import annotations

import logging
import re
import time

import redis
from flask import Blueprint, request
from sqlalchemy import and_, or_, select, update
from sqlalchemy.orm import defer

from app import limits
from app.api.common import check_served, db, enqueue, json_body, owned, owns, redis_client, served_model, settings
from app.auth import current_tenant
from app.errors import APIError
from app.serializers import batch_object
from llmq.protocol.openai import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT
from llmq.store.batch_lifecycle import expire_overdue, finalize_if_done  # torch-free bookkeeping
from llmq.store.models import Batch, BatchItem, BatchStatus, File, ItemStatus
from llmq.streams import request_cancel

log = logging.getLogger(__name__)

blueprint = Blueprint("batches", __name__, url_prefix="/v1")

ENDPOINTS = (COMPLETIONS_ENDPOINT, CHAT_ENDPOINT)
CANCELLABLE = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)
# OpenAI takes only "24h". llmq also takes any whole number of seconds, minutes or hours up to a week
# ("90s", "30m", "72h"), so a self-hosted queue can say how long its jobs may wait; "24h" stays the
# documented default. A batch still running when its window ends is expired.
_WINDOW = re.compile(r"([1-9][0-9]{0,5})([smh])")
_WINDOW_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600}
MAX_WINDOW_HOURS = 168
# OpenAI's metadata limits, so a client that passes here passes there too.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT = 20, 100


@blueprint.post("/batches")
def create_batch():
    body = json_body()
    input_file_id = body.get("input_file_id")
    if not isinstance(input_file_id, str) or not input_file_id:
        raise APIError(400, "you must provide input_file_id, the id of a file uploaded with purpose 'batch'",
                       param="input_file_id", code="missing_required_parameter")
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise APIError(400, f"endpoint {endpoint!r} is not supported: use one of "
                            f"{', '.join(ENDPOINTS)}", param="endpoint", code="invalid_value")
    return batch_object(create(input_file_id, endpoint, body.get("completion_window"), _metadata(body.get("metadata"))))


def create(input_file_id: str, endpoint: str, completion_window, metadata: dict | None) -> Batch:
    """A batch of the caller's file, queued for a worker to validate and fan out (404 for a file not the
    caller's, 400 for one not uploaded for batches, 503 when no worker serves the model or the queue is down)."""
    window, window_seconds = _completion_window(completion_window)
    model = served_model()
    check_served(model)
    caller = limits.current_limits()  # the batch keeps its creating key's limits for its lines
    with db().session() as session:
        file = session.get(File, input_file_id, options=[defer(File.content)])
        if file is None or file.deleted or not owns(file):
            raise APIError(404, f"No file found with id '{input_file_id}'", param="input_file_id",
                           code="not_found")
        if file.purpose != "batch":
            raise APIError(400, f"file '{input_file_id}' has purpose '{file.purpose}'; a batch's input must be "
                                "uploaded with purpose 'batch'", param="input_file_id", code="invalid_file_purpose")
        created = time.time()
        batch = Batch(tenant=current_tenant(), endpoint=endpoint, model=model, input_file_id=input_file_id,
                      completion_window=window, status=BatchStatus.VALIDATING, metadata_=metadata, created_at=created,
                      expires_at=created + window_seconds, max_tokens_limit=caller.max_tokens or None,
                      max_request_choices=caller.max_request_choices or None,
                      max_request_tokens=caller.max_request_tokens or None)
        session.add(batch)
    # Queued only after the row is committed, so the worker always finds it.
    try:
        enqueue("llmq.run_batch", [batch.id], model)
    except Exception:  # whatever broke (broker down, bad URL), no worker will ever see this batch
        log.exception("could not queue batch %s", batch.id)
        with db().session() as session:
            batch = session.get(Batch, batch.id)
            batch.status, batch.failed_at = BatchStatus.FAILED, time.time()
            batch.errors = {"object": "list", "data": [{"code": "queue_unavailable", "param": None, "line": None,
                                                        "message": "the task queue (Redis) did not accept the batch"}]}
        raise APIError(503, "the task queue (Redis) is unavailable, so the batch could not be queued; "
                            f"it is marked failed ({batch.id}). Try again later", code="queue_unavailable")
    return batch


@blueprint.get("/batches/<batch_id>")
def get_batch(batch_id: str):
    with db().read() as session:  # polled often: it waits for no writer
        batch = _batch(session, batch_id)
        overdue = batch.status in CANCELLABLE and batch.expires_at is not None and batch.expires_at <= time.time()
        if not overdue:
            return batch_object(batch)
    # Workers sweep for expired batches every few seconds; a poll need not wait for the next sweep.
    with db().session() as session:
        running = [request_id for _, ids in expire_overdue(session, time.time()) for request_id in ids]
    _stop_running(running)
    with db().read() as session:
        return batch_object(_batch(session, batch_id))


@blueprint.get("/batches")
def list_batches():
    """Newest first, as OpenAI does. `after` is the last id of the previous page: the next page holds
    the batches created before it."""
    limit = _list_limit(request.args.get("limit"))
    after = request.args.get("after")
    with db().read() as session:
        cursor = None
        if after:
            cursor = session.get(Batch, after)
            if cursor is None or not owns(cursor):
                raise APIError(400, f"after: no batch found with id '{after}' (pass the last_id of the previous page)",
                               param="after", code="invalid_value")
        rows, has_more = tenant_batches(session, cursor, limit)
        data = [batch_object(batch) for batch in rows]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def tenant_batches(session, cursor: Batch | None, limit: int) -> tuple[list[Batch], bool]:
    """A page of the caller's batches, newest first, after `cursor` (the last batch of the previous
    page), and whether more exist. The API's list and the dashboard's both page this way."""
    # id breaks ties between batches created in the same instant, so pages never overlap or skip.
    query = (select(Batch).where(Batch.tenant == current_tenant())
             .order_by(Batch.created_at.desc(), Batch.id.desc()))
    if cursor is not None:
        query = query.where(or_(Batch.created_at < cursor.created_at,
                                and_(Batch.created_at == cursor.created_at, Batch.id < cursor.id)))
    rows = session.scalars(query.limit(limit + 1)).all()  # one more than asked says whether more exist
    return rows[:limit], len(rows) > limit


@blueprint.post("/batches/<batch_id>/cancel")
def cancel_batch(batch_id: str):
    return batch_object(cancel(batch_id))


def cancel(batch_id: str) -> Batch:
    """validating / in_progress -> cancelling -> cancelled. Lines not started are cancelled here, running
    lines are told to stop; the batch is cancelled once none runs, with what finished in its output
    and error files. Cancelling a cancelling or cancelled batch answers it unchanged; a batch that
    already ended (or is finalizing) cannot be cancelled: 400."""
    with db().session() as session:
        # A conditional update, so a worker finalizing the batch at this moment is never overwritten.
        moved = session.execute(update(Batch).where(Batch.id == batch_id, Batch.tenant == current_tenant(),
                                                    Batch.status.in_(CANCELLABLE))
                                .values(status=BatchStatus.CANCELLING, cancelling_at=time.time())).rowcount
        batch = _batch(session, batch_id)
        if not moved and batch.status not in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
            raise APIError(400, f"batch {batch_id} is {batch.status} and cannot be cancelled (only validating or "
                                "in_progress batches can)", code="invalid_batch_status")
        if batch.status == BatchStatus.CANCELLED:
            return batch
    with db().session() as session:
        # A queued line's task would cancel itself when it comes (claim_item checks the batch), but
        # doing it now ends the batch at once even when no worker is consuming the queue.
        session.execute(update(BatchItem).where(BatchItem.batch_id == batch_id, BatchItem.status == ItemStatus.PENDING)
                        .values(status=ItemStatus.CANCELLED))
        running = session.scalars(select(BatchItem.request_id).where(
            BatchItem.batch_id == batch_id, BatchItem.status == ItemStatus.RUNNING, BatchItem.request_id.is_not(None))).all()
    _stop_running(running)
    with db().session() as session:
        finalize_if_done(session, batch_id)  # cancelled now if nothing runs; else the last line finalizes
        return session.get(Batch, batch_id)


def _stop_running(request_ids: list[str]) -> None:
    """Set each running line's cancel flag; its worker aborts the sequence at the next engine step."""
    try:
        for request_id in request_ids:
            request_cancel(redis_client(), request_id, settings().stream_ttl)
    except redis.RedisError:
        # Not fatal: the running lines finish normally and the last one still ends the batch as cancelled.
        log.warning("could not send cancel flags for %d running lines", len(request_ids), exc_info=True)


def _batch(session, batch_id: str) -> Batch:
    return owned(session, Batch, batch_id, "batch")


def _completion_window(value) -> tuple[str, int]:
    """The window as given ("24h") and its length in seconds."""
    match = _WINDOW.fullmatch(value) if isinstance(value, str) else None
    seconds = int(match.group(1)) * _WINDOW_UNIT_SECONDS[match.group(2)] if match else 0
    if not 0 < seconds <= MAX_WINDOW_HOURS * 3600:
        raise APIError(400, f"completion_window must be '24h' (or a whole number of seconds, minutes or hours, "
                            f"like '90s', '30m' or '72h', up to '{MAX_WINDOW_HOURS}h'), got {value!r}",
                       param="completion_window", code="invalid_value")
    return value, seconds


def _metadata(value) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise APIError(400, "metadata must be an object of string keys and string values",
                       param="metadata", code="invalid_value")
    if len(value) > MAX_METADATA_PAIRS:
        raise APIError(400, f"metadata has {len(value)} pairs; at most {MAX_METADATA_PAIRS} are allowed",
                       param="metadata", code="invalid_value")
    for key, item in value.items():
        if not isinstance(item, str):
            raise APIError(400, f"metadata[{key!r}] must be a string, got {type(item).__name__}",
                           param="metadata", code="invalid_value")
        if len(key) > MAX_METADATA_KEY or len(item) > MAX_METADATA_VALUE:
            raise APIError(400, f"metadata keys take at most {MAX_METADATA_KEY} characters and values at most "
                                f"{MAX_METADATA_VALUE}; {key[:64]!r} is over", param="metadata", code="invalid_value")
    return value


def _list_limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_LIST_LIMIT
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise APIError(400, f"limit must be an integer from 1 to {MAX_LIST_LIMIT}, got {raw!r}",
                       param="limit", code="invalid_value")
    return limit
