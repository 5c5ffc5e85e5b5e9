"""The OpenAI Files API: upload a batch input file, list, get, download, delete.

Content lives in the database (see llmq.store.models.File), so every web process and worker reads the same
bytes. An upload is only stored, not checked: as with OpenAI, the lines are validated when a batch is
created from the file, and each bad line becomes one error line of that batch.
"""
from __future__ import annotations

import io

from flask import Blueprint, request, send_file
from sqlalchemy import select
from sqlalchemy.orm import Session, defer

from app.api.common import db, owned
from app.auth import current_tenant
from app.errors import APIError, not_found
from app.limits import check_batch_lines, current_limits
from app.serializers import file_deleted_object, file_object
from llmq.protocol.openai import jsonl_lines
from llmq.store.models import File

blueprint = Blueprint("files", __name__, url_prefix="/v1")

# Clients upload batch inputs only; "batch_output" files are written by the batch bookkeeping.
UPLOAD_PURPOSES = ("batch",)
MAX_FILENAME_CHARS = 500  # the width of files.filename


@blueprint.post("/files")
def upload_file():
    # Touching request.files parses the multipart body. A body over the caller's upload limit (set as
    # request.max_content_length by app.limits) makes Werkzeug raise 413 right here, before it is read
    # into memory; app.errors turns that into the OpenAI error shape.
    upload = request.files.get("file")
    purpose = request.form.get("purpose")
    if upload is None:
        raise APIError(400, "you must provide a file: POST /v1/files takes multipart/form-data with the "
                            "content in a file part named 'file' and a 'purpose' field", param="file",
                       code="missing_file")
    if not purpose:
        raise APIError(400, "you must provide a purpose ('batch')", param="purpose", code="missing_purpose")
    if purpose not in UPLOAD_PURPOSES:
        raise APIError(400, f"purpose {purpose!r} is not supported: llmq accepts uploads with purpose "
                            f"{' or '.join(repr(p) for p in UPLOAD_PURPOSES)}", param="purpose",
                       code="invalid_purpose")
    return file_object(store_upload(upload.filename, purpose, upload.read()))


def store_upload(filename: str | None, purpose: str, content: bytes) -> File:
    """An uploaded file stored for the caller, once it is within the caller's limits (413, 400)."""
    limit = current_limits().max_upload_bytes
    # max_content_length bounds the whole request; this also covers a body without Content-Length.
    if len(content) > limit:
        raise APIError(413, f"the file is {len(content)} bytes; this server accepts at most {limit} bytes from you "
                            "(LLMQ_MAX_UPLOAD_BYTES, or your API key's own limit)", param="file",
                       code="request_too_large")
    if purpose == "batch":  # refused now rather than failing the batch made from it later
        check_batch_lines(len(jsonl_lines(content.decode("utf-8", "replace"))))  # as the batch counts them
    with db().session() as session:
        file = File(tenant=current_tenant(), filename=(filename or "upload.jsonl")[:MAX_FILENAME_CHARS],
                    purpose=purpose, bytes=len(content), content=content)
        session.add(file)
        session.flush()  # assigns created_at
        return file


@blueprint.get("/files")
def list_files():
    """The caller's files not deleted, newest first. llmq keeps few files (batch inputs and outputs), so
    the list is one page: has_more is always false. `purpose` filters, as in OpenAI's API."""
    query = (select(File).where(File.tenant == current_tenant(), File.deleted.is_(False))
             .options(defer(File.content))  # metadata only
             .order_by(File.created_at.desc(), File.id.desc()))
    purpose = request.args.get("purpose")
    if purpose:
        query = query.where(File.purpose == purpose)
    with db().read() as session:
        data = [file_object(file) for file in session.scalars(query)]
    return {"object": "list", "data": data, "has_more": False}


@blueprint.get("/files/<file_id>")
def get_file(file_id: str):
    with db().read() as session:
        return file_object(_live_file(session, file_id))


@blueprint.get("/files/<file_id>/content")
def file_content(file_id: str):
    with db().read() as session:
        file = _live_file(session, file_id, with_content=True)
        content, filename = file.content, file.filename
    # send_file writes a Content-Disposition that is safe for any filename (RFC 5987 for non-ASCII).
    return send_file(io.BytesIO(content), mimetype="application/octet-stream", as_attachment=True,
                     download_name=filename, etag=False, conditional=False)


@blueprint.delete("/files/<file_id>")
def delete_file(file_id: str):
    """Marks the file deleted: it answers 404 from now on. The bytes stay, because a batch created
    from it may not have read its input yet."""
    with db().session() as session:
        _live_file(session, file_id).deleted = True
    return file_deleted_object(file_id)


def _live_file(session: Session, file_id: str, with_content: bool = False) -> File:
    """The caller's file, unless it never existed or was deleted (404 in the OpenAI shape, as for
    another tenant's). Its bytes are read only when asked for: they can be hundreds of megabytes."""
    file = owned(session, File, file_id, "file", options=() if with_content else (defer(File.content),))
    if file.deleted:
        raise not_found("file", file_id)
    return file
