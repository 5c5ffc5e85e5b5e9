"""A batch's life in the database: validating -> in_progress -> finalizing -> completed (or failed,
cancelling -> cancelled, or expired once its completion window has passed). Plain SQL bookkeeping,
no torch: the web process uses it too.

Every line becomes one BatchItem. An item's result (its output or error line) is written once, in the
same transaction that moves the batch's counts, so a redelivered task never counts a line twice and
a finished line is never redone. Whoever finishes the last line finalizes, guarded by a conditional
status update so exactly one does.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from sqlalchemy import exists, select, update
from sqlalchemy.orm import Session

from llmq.errors import InvalidRequest
from llmq.model.tokenizer import Tokenizer
from llmq.protocol.openai import (
    CHAT_ENDPOINT,
    BatchLineError,
    batch_error_line,
    batch_output_line,
    jsonl_lines,
    line_error_message,
    parse_batch_line,
)
from llmq.protocol.prepare import CHAT, COMPLETION, ServedModel, prepare
from llmq.store.models import (
    TERMINAL_ITEM_STATES,
    UNFINISHED_ITEM_STATES,
    Batch,
    BatchItem,
    BatchStatus,
    File,
    ItemStatus,
)

log = logging.getLogger(__name__)

# Someone is waiting on an API request; nobody is on one batch line. Batch lines are queued at a lower
# broker priority (kombu reads a Redis queue's priority lists in order, 0 first), so an app's request
# does not wait behind a bulk job's backlog.
BATCH_BROKER_PRIORITY = 6


@dataclass(frozen=True)
class InputRefused:
    """Why a whole input file is refused: the batch fails with this error."""

    code: str
    message: str


def expand_input(session: Session, batch: Batch, model: ServedModel, tokenizer: Tokenizer,
                 max_lines: int) -> list[int]:
    """validating -> in_progress (or failed), in one session: `read_input`, then `store_input`."""
    content = session.get(File, batch.input_file_id).content
    return store_input(session, batch.id, read_input(batch, content, model, tokenizer, max_lines))


def read_input(batch: Batch, content: bytes, model: ServedModel, tokenizer: Tokenizer,
               max_lines: int) -> list[BatchItem] | InputRefused:
    """One BatchItem per input line, its body prepared (llmq/protocol/prepare.py); a bad line is a
    failed item with its error line written. No database: a large file is parsed and tokenized
    outside any transaction, so it holds no write lock meanwhile (on SQLite, every writer waits)."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        return InputRefused("invalid_file", "the input file is not UTF-8 text")
    numbered = jsonl_lines(text)
    if not numbered:
        return InputRefused("empty_file", "the input file has no request lines")
    if len(numbered) > max_lines:
        return InputRefused("too_many_lines", f"the input file has {len(numbered)} lines; this server takes at "
                                              f"most {max_lines}")
    kind = CHAT if batch.endpoint == CHAT_ENDPOINT else COMPLETION
    seen: set[str] = set()
    return [_item(batch, kind, line_no, line, model, tokenizer, seen) for line_no, line in numbered]


def store_input(session: Session, batch_id: str, items: list[BatchItem] | InputRefused) -> list[int]:
    """What `read_input` made, stored: the batch in_progress with its items (or failed). Only a batch
    still validating moves on: a cancel that landed meanwhile wins. Returns the ids of the items to run."""
    batch = session.get(Batch, batch_id)
    if isinstance(items, InputRefused):
        return _fail_batch(batch, items.code, items.message)
    started = session.execute(update(Batch).where(Batch.id == batch_id, Batch.status == BatchStatus.VALIDATING).values(
        status=BatchStatus.IN_PROGRESS, in_progress_at=time.time(), total=len(items),
        failed=sum(item.status == ItemStatus.FAILED for item in items))).rowcount
    if not started:
        return []
    session.add_all(items)
    session.flush()
    return [item.id for item in items if item.status == ItemStatus.PENDING]


def _item(batch: Batch, kind: str, line_no: int, line: str, model: ServedModel, tokenizer: Tokenizer,
          seen: set[str]) -> BatchItem:
    """One input line as a BatchItem: pending with its prepared request, or failed with its error line."""
    item = BatchItem(batch_id=batch.id, line=line_no, status=ItemStatus.PENDING)
    try:
        parsed = parse_batch_line(line, line_no, batch.endpoint)
        item.custom_id, item.body = parsed.custom_id, parsed.body
        if parsed.custom_id in seen:
            raise BatchLineError(f"line {line_no}: custom_id {parsed.custom_id!r} appears earlier in the file",
                                 "duplicate_custom_id", line_no, parsed.custom_id)
        seen.add(parsed.custom_id)
        asked_model = parsed.body.get("model")
        if asked_model is not None and asked_model != model.name:
            raise BatchLineError(f"line {line_no}: model {asked_model!r} is not served here (this server runs "
                                 f"{model.name!r})", "model_not_found", line_no, parsed.custom_id)
        prepared = prepare(kind, parsed.body, tokenizer, model)
        asked = prepared.params.max_tokens
        if batch.max_tokens_limit and asked > batch.max_tokens_limit:
            raise InvalidRequest(f"max_tokens is {asked}; the API key that created this batch allows at most "
                                 f"{batch.max_tokens_limit}", "max_tokens")
        prepared.check_size(batch.max_request_choices or 0, batch.max_request_tokens or 0)
        item.prepared = prepared.to_json()
    except BatchLineError as err:
        _set_result(item, ItemStatus.FAILED, batch_error_line(err.custom_id, err.code, str(err), err.line))
    except InvalidRequest as err:
        _set_result(item, ItemStatus.FAILED, batch_error_line(item.custom_id, err.code, line_error_message(err, line_no),
                                                              line_no))
    return item


def claim_item(session: Session, item_id: int, request_id: str) -> tuple[BatchItem, Batch] | None:
    """Mark an item running; None if it is already finished (a redelivery after the result was
    written) or its batch is no longer running. The item keeps the request id of its first claim (a
    conditional update, so two deliveries at once agree on it): a redelivered line resumes that
    request's checkpoint instead of starting over."""
    item = session.get(BatchItem, item_id)
    if item is None or item.status in TERMINAL_ITEM_STATES:
        return None
    batch = session.get(Batch, item.batch_id)
    if batch.status != BatchStatus.IN_PROGRESS:
        record_result(session, item_id, ItemStatus.CANCELLED, None)
        return None
    session.execute(update(BatchItem).where(BatchItem.id == item_id, BatchItem.request_id.is_(None))
                    .values(request_id=request_id))
    session.refresh(item)
    item.status = ItemStatus.RUNNING
    return item, batch


def pending_items(session: Session, batch_id: str) -> list[BatchItem]:
    return list(session.scalars(select(BatchItem).where(BatchItem.batch_id == batch_id,
                                                        BatchItem.status.in_(UNFINISHED_ITEM_STATES))))


def record_result(session: Session, item_id: int, status: ItemStatus, line: dict | None) -> bool:
    """Write an item's result once and move its batch's counts in the same transaction."""
    result = json.dumps(line) if line is not None else None
    changed = session.execute(
        update(BatchItem).where(BatchItem.id == item_id, BatchItem.status.not_in(TERMINAL_ITEM_STATES))
        .values(status=status, result=result)).rowcount
    if not changed:
        return False
    batch_id = session.get(BatchItem, item_id).batch_id
    if status in (ItemStatus.COMPLETED, ItemStatus.FAILED):
        column = Batch.completed if status == ItemStatus.COMPLETED else Batch.failed
        tokens = _completion_tokens(line)
        session.execute(update(Batch).where(Batch.id == batch_id).values(
            {column: column + 1, Batch.completion_tokens: Batch.completion_tokens + tokens}))
    return True


def _completion_tokens(line: dict | None) -> int:
    """The tokens an output line's response says it generated (0 for an error line)."""
    body = ((line or {}).get("response") or {}).get("body") or {}
    return int((body.get("usage") or {}).get("completion_tokens") or 0)


def success_line(custom_id: str, response: dict) -> dict:
    return batch_output_line(custom_id, response)


def has_unfinished_items(session: Session, batch_id: str) -> bool:
    """Whether a line of the batch is still to run. Every line asks this when it ends: an index seek
    on (batch_id, status) for one unfinished row, not a count of the batch's rows, which made a batch
    of n lines cost n^2 / 2 row visits."""
    return bool(session.scalar(select(exists().where(BatchItem.batch_id == batch_id,
                                                     BatchItem.status.in_(UNFINISHED_ITEM_STATES)))))


def finalize_if_done(session: Session, batch_id: str) -> str | None:
    """If no item is left to run, write the output and error files and end the batch. Returns the
    new status, or None if the batch is not done (or another process is finalizing it)."""
    if has_unfinished_items(session, batch_id):
        return None
    now = time.time()
    claimed = session.execute(update(Batch).where(Batch.id == batch_id, Batch.status.in_((BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING)))
                              .values(finalizing_at=now)).rowcount
    if not claimed:
        return None
    batch = session.get(Batch, batch_id)
    cancelling = batch.status == BatchStatus.CANCELLING
    batch.status = BatchStatus.FINALIZING if not cancelling else batch.status
    _write_result_files(session, batch)
    if cancelling:
        batch.status, batch.cancelled_at = BatchStatus.CANCELLED, now
    else:
        batch.status, batch.completed_at = BatchStatus.COMPLETED, now
    log.info("batch %s %s: %d completed, %d failed", batch_id, batch.status, batch.completed, batch.failed)
    return batch.status


EXPIRED_MESSAGE = "This request could not be executed before the batch's completion window expired."


def expire_overdue(session: Session, now: float) -> list[tuple[str, list[str]]]:
    """Batches still validating or in progress at their expires_at become expired: every line not yet
    done becomes a `batch_expired` error line, and the output file holds the lines already done.
    Returns (batch id, request ids of its lines still running) for each, so the caller can cancel them;
    a result such a line writes later is refused (its item is already ended)."""
    live = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)
    overdue = session.scalars(select(Batch.id).where(Batch.status.in_(live), Batch.expires_at.is_not(None),
                                                     Batch.expires_at <= now)).all()
    expired = []
    for batch_id in overdue:
        if not session.execute(update(Batch).where(Batch.id == batch_id, Batch.status.in_(live))
                               .values(status=BatchStatus.EXPIRED, expired_at=now)).rowcount:
            continue  # it finished (or was cancelled) meanwhile
        unfinished = session.scalars(select(BatchItem).where(
            BatchItem.batch_id == batch_id, BatchItem.status.not_in(TERMINAL_ITEM_STATES))).all()
        running = [item.request_id for item in unfinished if item.status == ItemStatus.RUNNING and item.request_id]
        for item in unfinished:
            record_result(session, item.id, ItemStatus.FAILED,
                          batch_error_line(item.custom_id, "batch_expired", EXPIRED_MESSAGE, item.line))
        batch = session.get(Batch, batch_id, populate_existing=True)
        _write_result_files(session, batch)
        log.info("batch %s expired: %d lines done, %d not", batch_id, batch.completed, len(unfinished))
        expired.append((batch_id, running))
    return expired


def request_counts(batch: Batch) -> dict:
    return {"total": batch.total, "completed": batch.completed, "failed": batch.failed}


def _write_result_files(session: Session, batch: Batch) -> None:
    """The output file (completed lines) and the error file (failed lines), in input order."""
    items = session.scalars(select(BatchItem).where(BatchItem.batch_id == batch.id).order_by(BatchItem.line)).all()
    outputs = [i.result for i in items if i.status == ItemStatus.COMPLETED]
    errors = [i.result for i in items if i.status == ItemStatus.FAILED]
    if outputs:
        batch.output_file_id = _write_file(session, batch.tenant, f"{batch.id}_output.jsonl", outputs)
    if errors:
        batch.error_file_id = _write_file(session, batch.tenant, f"{batch.id}_errors.jsonl", errors)


def _write_file(session: Session, tenant: str, filename: str, lines: list[str]) -> str:
    """A batch's output or error file, owned by the batch's tenant (only they may read it)."""
    content = ("\n".join(lines) + "\n").encode()
    file = File(tenant=tenant, filename=filename, purpose="batch_output", bytes=len(content), content=content)
    session.add(file)
    session.flush()
    return file.id


def _set_result(item: BatchItem, status: ItemStatus, line: dict) -> None:
    item.status, item.result = status, json.dumps(line)


def _fail_batch(batch: Batch, code: str, message: str) -> list[int]:
    if batch.status == BatchStatus.VALIDATING:
        batch.status, batch.failed_at = BatchStatus.FAILED, time.time()
        batch.errors = {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]}
    return []
