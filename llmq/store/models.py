"""SQLAlchemy tables: requests, files, batches, batch items, API keys. Created by the Alembic migrations.

Requests, files and batches belong to a tenant (the tenant of the API key that made them, "default"
on an install without keys); the API shows a tenant only its own rows (app/api/common.owned).
"""
from __future__ import annotations

import time
from enum import StrEnum

from sqlalchemy import JSON, ForeignKey, Index, Integer, LargeBinary, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from llmq.protocol.openai import new_id


def now() -> float:
    return time.time()


class Base(DeclarativeBase):
    pass


class _Status(StrEnum):
    @property
    def terminal(self) -> bool:
        """Ended for good: nothing moves it on (a redelivered task finds it so and skips)."""
        return self.value in ("completed", "failed", "cancelled", "expired")


class RequestStatus(_Status):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class BatchStatus(_Status):
    """OpenAI's batch statuses: validating -> in_progress -> finalizing -> completed (or failed,
    expired, cancelling -> cancelled)."""

    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


class ItemStatus(_Status):
    """A batch line's."""

    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL_REQUEST_STATES = tuple(s for s in RequestStatus if s.terminal)
TERMINAL_ITEM_STATES = tuple(s for s in ItemStatus if s.terminal)
UNFINISHED_ITEM_STATES = tuple(s for s in ItemStatus if not s.terminal)


DEFAULT_TENANT = "default"  # who owns everything on an install without API keys (and rows made before keys)
TENANT_CHARS = 64


def tenant_column() -> Mapped[str]:
    # server_default too, so rows that existed before tenancy (migration 0002) belong to "default".
    return mapped_column(String(TENANT_CHARS), default=DEFAULT_TENANT, server_default=DEFAULT_TENANT, index=True)


class Request(Base):
    """One completion request (a single API call, or one line of a batch), and its result."""

    __tablename__ = "requests"

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=lambda: new_id("req_"))
    tenant: Mapped[str] = tenant_column()
    kind: Mapped[str] = mapped_column(String(16), default="completion")  # completion | chat
    model: Mapped[str] = mapped_column(String(200))
    body: Mapped[dict] = mapped_column(JSON)  # the request body as the client sent it (validated)
    # The body as llmq/protocol/prepare.py made it at intake (PreparedRequest.to_json): what the worker runs.
    prepared: Mapped[dict | None] = mapped_column(JSON, default=None)
    status: Mapped[str] = mapped_column(String(16), default=RequestStatus.QUEUED)
    batch_id: Mapped[str | None] = mapped_column(ForeignKey("batches.id"), index=True, default=None)
    response: Mapped[dict | None] = mapped_column(JSON, default=None)  # the completion object when done
    error: Mapped[dict | None] = mapped_column(JSON, default=None)  # {"code", "message"} when failed
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[float] = mapped_column(default=now)
    started_at: Mapped[float | None] = mapped_column(default=None)
    first_token_at: Mapped[float | None] = mapped_column(default=None)
    finished_at: Mapped[float | None] = mapped_column(default=None)


class File(Base):
    """An uploaded or generated file. Content lives in the database, so every machine can read it."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=lambda: new_id("file-"))
    tenant: Mapped[str] = tenant_column()
    filename: Mapped[str] = mapped_column(String(500))
    purpose: Mapped[str] = mapped_column(String(32))  # batch | batch_output
    bytes: Mapped[int] = mapped_column(Integer)
    content: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[float] = mapped_column(default=now)
    deleted: Mapped[bool] = mapped_column(default=False)


class Batch(Base):
    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=lambda: new_id("batch_"))
    tenant: Mapped[str] = tenant_column()
    endpoint: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(200))
    input_file_id: Mapped[str] = mapped_column(ForeignKey("files.id"))
    completion_window: Mapped[str] = mapped_column(String(16), default="24h")
    # The creating key's max_tokens limit, if it has one: a line asking for more is an error line.
    max_tokens_limit: Mapped[int | None] = mapped_column(Integer, default=None)
    # One line's size limits as they were for the creating key (Limits.max_request_*; None: none).
    max_request_choices: Mapped[int | None] = mapped_column(Integer, default=None)
    max_request_tokens: Mapped[int | None] = mapped_column(Integer, default=None)
    status: Mapped[str] = mapped_column(String(16), default=BatchStatus.VALIDATING)
    metadata_: Mapped[dict | None] = mapped_column("metadata", JSON, default=None)
    errors: Mapped[dict | None] = mapped_column(JSON, default=None)
    output_file_id: Mapped[str | None] = mapped_column(String(64), default=None)
    error_file_id: Mapped[str | None] = mapped_column(String(64), default=None)
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # of its finished lines
    created_at: Mapped[float] = mapped_column(default=now)
    in_progress_at: Mapped[float | None] = mapped_column(default=None)
    expires_at: Mapped[float | None] = mapped_column(default=None)
    finalizing_at: Mapped[float | None] = mapped_column(default=None)
    completed_at: Mapped[float | None] = mapped_column(default=None)
    failed_at: Mapped[float | None] = mapped_column(default=None)
    expired_at: Mapped[float | None] = mapped_column(default=None)
    cancelling_at: Mapped[float | None] = mapped_column(default=None)
    cancelled_at: Mapped[float | None] = mapped_column(default=None)


class BatchItem(Base):
    """One line of a batch input file. `result` is the whole output or error line, written once."""

    __tablename__ = "batch_items"
    __table_args__ = (Index("ix_batch_items_batch_status", "batch_id", "status"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id"))
    line: Mapped[int] = mapped_column(Integer)
    custom_id: Mapped[str | None] = mapped_column(String(500), default=None)
    body: Mapped[dict | None] = mapped_column(JSON, default=None)
    prepared: Mapped[dict | None] = mapped_column(JSON, default=None)  # as Request.prepared, made when the file is read
    status: Mapped[str] = mapped_column(String(16), default=ItemStatus.PENDING)
    request_id: Mapped[str | None] = mapped_column(String(64), default=None)
    result: Mapped[str | None] = mapped_column(Text, default=None)  # the JSONL line for the output/error file


class ApiKey(Base):
    """An API key. Only the SHA-256 of its secret is stored: the secret is shown once, at creation.

    A fast hash is right here (no bcrypt or scrypt): the secrets are 32 random bytes, not passwords a
    person chose, so there is nothing to guess a dictionary against and brute force over 2^256 is out
    of reach at any hashing speed; a fast, unsalted hash also lets a request find its key with one
    indexed lookup. The limit columns override the server-wide defaults (llmq.settings) when set.
    """

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=lambda: new_id("key_"))
    tenant: Mapped[str] = mapped_column(String(TENANT_CHARS), index=True)
    name: Mapped[str] = mapped_column(String(200), default="")
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the secret
    display_prefix: Mapped[str] = mapped_column(String(16))  # the secret's first characters, to tell keys apart
    created_at: Mapped[float] = mapped_column(default=now)
    revoked_at: Mapped[float | None] = mapped_column(default=None)
    rate_limit_rpm: Mapped[int | None] = mapped_column(Integer, default=None)  # requests per minute; 0 = unlimited
    rate_limit_tpm: Mapped[int | None] = mapped_column(Integer, default=None)  # tokens per minute; 0 = unlimited
    max_upload_bytes: Mapped[int | None] = mapped_column(Integer, default=None)
    max_batch_lines: Mapped[int | None] = mapped_column(Integer, default=None)
    max_tokens: Mapped[int | None] = mapped_column(Integer, default=None)
    max_request_choices: Mapped[int | None] = mapped_column(Integer, default=None)  # prompts x n in one request
    max_request_tokens: Mapped[int | None] = mapped_column(Integer, default=None)  # prompt + max_tokens x choices
