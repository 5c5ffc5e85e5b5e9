"""Database rows -> the OpenAI JSON objects (file, batch). Shared by the API and anyone who answers
with these objects, so every caller returns the same shape.

The database keeps float unix times; OpenAI's objects carry whole seconds (or null).
"""
from __future__ import annotations

from llmq.store.batch_lifecycle import request_counts  # torch-free bookkeeping
from llmq.store.models import Batch, File


def unix_seconds(value: float | None) -> int | None:
    return None if value is None else int(value)


def file_object(file: File) -> dict:
    """The OpenAI file object. Files are usable as soon as they are stored, hence "processed"; llmq
    never expires them."""
    return {
        "id": file.id,
        "object": "file",
        "bytes": file.bytes,
        "created_at": unix_seconds(file.created_at),
        "filename": file.filename,
        "purpose": file.purpose,
        "status": "processed",
        "expires_at": None,
    }


def file_deleted_object(file_id: str) -> dict:
    return {"id": file_id, "object": "file", "deleted": True}


def batch_object(batch: Batch) -> dict:
    """The OpenAI batch object, field for field as in /work/shared/reference/openai-api.md."""
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": batch.errors,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": unix_seconds(batch.created_at),
        "in_progress_at": unix_seconds(batch.in_progress_at),
        "expires_at": unix_seconds(batch.expires_at),
        "finalizing_at": unix_seconds(batch.finalizing_at),
        "completed_at": unix_seconds(batch.completed_at),
        "failed_at": unix_seconds(batch.failed_at),
        "expired_at": unix_seconds(batch.expired_at),
        "cancelling_at": unix_seconds(batch.cancelling_at),
        "cancelled_at": unix_seconds(batch.cancelled_at),
        "request_counts": request_counts(batch),
        "metadata": batch.metadata_ or {},
    }
