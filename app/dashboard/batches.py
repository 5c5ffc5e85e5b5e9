"""The batches pages: every batch of the caller's tenant with its progress (live while any runs), an
upload that checks its lines before it makes a batch, and one batch: its lines (paged, filtered by
status), its errors, its output and error files, cancel."""
from __future__ import annotations

import json
import time

from flask import redirect, render_template, request, url_for
from sqlalchemy import func, select

from app.api import batches as batches_api
from app.api.common import db, owned, served_model, settings, tokenizer
from app.api.files import store_upload
from app.dashboard.blueprint import blueprint
from app.errors import APIError
from app.limits import current_limits
from app.services import services
from llmq.protocol.openai import COMPLETIONS_ENDPOINT
from llmq.store.batch_lifecycle import InputRefused, read_input
from llmq.store.batch_progress import batch_progress
from llmq.store.models import Batch, BatchItem, BatchStatus, ItemStatus

PAGE_SIZE = 25  # batches a page
LINES_PAGE_SIZE = 50
SHOWN_LINE_ERRORS = 20  # an upload's bad lines listed (and how many more)
LIVE_STATES = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING, BatchStatus.CANCELLING)


@blueprint.get("/batches")
def batches():
    return render_template("dashboard/batches.html", **_batch_table(request.args.get("after")),
                           endpoints=batches_api.ENDPOINTS, line_errors=None, upload_error=None)


@blueprint.get("/batches/table")
def batches_table():
    return render_template("dashboard/_batches_table.html", **_batch_table(request.args.get("after")))


@blueprint.post("/batches")
def submit_batch():
    """Upload a file and make a batch of it. Its lines are checked first, as the worker will check
    them: a file with bad lines is refused with their numbers and what is wrong, unless the person
    asks to run the good lines anyway (the bad ones then become the batch's error lines)."""
    upload = request.files.get("file")
    endpoint = request.form.get("endpoint", COMPLETIONS_ENDPOINT)
    if upload is None or not upload.filename:
        return _refused(upload_error="Choose a JSONL file to upload: one request a line, each with a custom_id.")
    if endpoint not in batches_api.ENDPOINTS:
        return _refused(upload_error=f"The endpoint must be one of {', '.join(batches_api.ENDPOINTS)}.")
    content = upload.read()
    problems = check_lines(content, endpoint)
    if problems and not request.form.get("run_anyway"):
        return _refused(line_errors=problems, filename=upload.filename)
    try:
        file = store_upload(upload.filename, "batch", content)
        batch = batches_api.create(file.id, endpoint, request.form.get("completion_window") or "24h", None)
    except APIError as err:
        return _refused(upload_error=err.message)
    return redirect(url_for("dashboard.batch", batch_id=batch.id))


def check_lines(content: bytes, endpoint: str) -> list[str]:
    """What is wrong with the file, a message a line (each says its line number), by the workers' own
    reading of a batch input (llmq/store/batch_lifecycle.read_input)."""
    limits = current_limits()
    probe = Batch(id="upload-check", endpoint=endpoint, max_tokens_limit=limits.max_tokens or None,
                  max_request_choices=limits.max_request_choices or None,
                  max_request_tokens=limits.max_request_tokens or None)
    items = read_input(probe, content, services().model, tokenizer(), settings().max_batch_lines)
    if isinstance(items, InputRefused):
        return [items.message]
    return [json.loads(item.result)["error"]["message"] for item in items if item.status == ItemStatus.FAILED]


def _refused(line_errors: list[str] | None = None, upload_error: str | None = None, filename: str | None = None):
    shown = line_errors[:SHOWN_LINE_ERRORS] if line_errors else None
    more = len(line_errors) - len(shown) if line_errors else 0
    return render_template("dashboard/batches.html", **_batch_table(None), endpoints=batches_api.ENDPOINTS,
                           line_errors=shown, more_line_errors=more, upload_error=upload_error,
                           filename=filename), 400


def _batch_table(after: str | None) -> dict:
    """A page of the tenant's batches, newest first, each with its progress; `after` is the last id
    of the previous page."""
    with db().read() as session:
        cursor = owned(session, Batch, after, "batch") if after else None
        page, has_more = batches_api.tenant_batches(session, cursor, PAGE_SIZE)
    now = time.time()
    shown = [(batch, batch_progress(batch, now)) for batch in page]
    return {"rows": shown, "next_after": page[-1].id if has_more else None, "after": after,
            "live": any(batch.status in LIVE_STATES for batch in page), "model": served_model()}


# ---- one batch ----------------------------------------------------------------------------------

@blueprint.get("/batches/<batch_id>")
def batch(batch_id: str):
    return render_template("dashboard/batch.html", **_summary(batch_id), **_lines(batch_id),
                           item_states=tuple(ItemStatus))


@blueprint.get("/batches/<batch_id>/summary")
def batch_summary(batch_id: str):
    return render_template("dashboard/_batch_summary.html", **_summary(batch_id))


@blueprint.get("/batches/<batch_id>/lines")
def batch_lines(batch_id: str):
    return render_template("dashboard/_batch_lines.html", **_summary(batch_id), **_lines(batch_id))


@blueprint.post("/batches/<batch_id>/cancel")
def cancel_batch(batch_id: str):
    batches_api.cancel(batch_id)
    return redirect(url_for("dashboard.batch", batch_id=batch_id))


def _summary(batch_id: str) -> dict:
    with db().read() as session:
        row = owned(session, Batch, batch_id, "batch")
    return {"batch": row, "progress": batch_progress(row, time.time()), "live": row.status in LIVE_STATES,
            "cancellable": row.status in batches_api.CANCELLABLE,
            "batch_errors": (row.errors or {}).get("data", [])}


def _lines(batch_id: str) -> dict:
    """A page of the batch's lines in input order, of one status if the page asks (?status=, ?page=)."""
    status = request.args.get("status") or None
    if status not in tuple(ItemStatus):
        status = None
    page = max(1, request.args.get("page", 1, type=int))
    query = select(BatchItem).where(BatchItem.batch_id == batch_id)
    if status:
        query = query.where(BatchItem.status == status)
    with db().read() as session:
        counts = dict(session.execute(select(BatchItem.status, func.count()).where(BatchItem.batch_id == batch_id)
                                      .group_by(BatchItem.status)).all())
        items = session.scalars(query.order_by(BatchItem.line).offset((page - 1) * LINES_PAGE_SIZE)
                                .limit(LINES_PAGE_SIZE + 1)).all()
    shown = items[:LINES_PAGE_SIZE]
    return {"lines": [(item, *line_outcome(item.result)) for item in shown], "line_counts": counts,
            "has_next_page": len(items) > LINES_PAGE_SIZE, "status_filter": status, "page": page}


def line_outcome(result: str | None) -> tuple[str | None, str | None]:
    """A finished line's (text, error message) from its output or error line."""
    if result is None:
        return None, None
    line = json.loads(result)
    if line.get("error"):
        return None, line["error"].get("message")
    body = (line.get("response") or {}).get("body") or {}
    choices = body.get("choices") or [{}]
    first = choices[0]
    return (first.get("message") or {}).get("content", first.get("text")), None

