"""API keys: made, found and revoked. Plain SQL, no Flask: the `llmq keys` command uses it too.

A key's secret is `llmq-` and 43 URL-safe characters (32 random bytes). Only its SHA-256 is stored
(llmq.store.models.ApiKey says why a fast hash is right), so the secret is shown once, when it is made, and
a lost secret is replaced by a new key, never recovered.
"""
from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import dataclass, fields

from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from llmq.store.models import TENANT_CHARS, ApiKey

SECRET_PREFIX = "llmq-"
SECRET_BYTES = 32
DISPLAY_CHARS = 12  # "llmq-" and 7 random characters: enough to tell keys apart, far too few to guess one
# Well-formed secrets only; anything else is answered "malformed" without touching the database.
SECRET_PATTERN = re.compile(re.escape(SECRET_PREFIX) + r"[A-Za-z0-9_-]{20,200}")
# Tenants appear in Redis key names (llmq:idem:{tenant}:...), so no colons, spaces or the like.
TENANT_PATTERN = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{TENANT_CHARS - 1}}}")


@dataclass(frozen=True)
class KeyLimits:
    """A key's own limits; None leaves the server-wide default (llmq.settings.Settings) in force."""

    rate_limit_rpm: int | None = None
    rate_limit_tpm: int | None = None
    max_upload_bytes: int | None = None
    max_batch_lines: int | None = None
    max_tokens: int | None = None
    max_request_choices: int | None = None
    max_request_tokens: int | None = None

    def __post_init__(self):
        for field in fields(self):
            value = getattr(self, field.name)
            if value is not None and value < 0:
                raise ValueError(f"{field.name} must be 0 or more, got {value}")


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def check_tenant(tenant: str) -> str:
    if not TENANT_PATTERN.fullmatch(tenant or ""):
        raise ValueError(f"tenant must be 1 to {TENANT_CHARS} letters, digits, '_', '.' or '-' (starting with a "
                         f"letter or digit), got {tenant!r}")
    return tenant


def create_key(session: Session, tenant: str, name: str = "", limits: KeyLimits = KeyLimits()) -> tuple[ApiKey, str]:
    """Store a new key for `tenant`; returns the row and the secret, which is never stored."""
    secret = SECRET_PREFIX + secrets.token_urlsafe(SECRET_BYTES)
    key = ApiKey(tenant=check_tenant(tenant), name=name, key_hash=hash_secret(secret),
                 display_prefix=secret[:DISPLAY_CHARS], created_at=time.time(),
                 **{field.name: getattr(limits, field.name) for field in fields(limits)})
    session.add(key)
    session.flush()
    return key, secret


def find_key(session: Session, secret: str) -> ApiKey | None:
    """The key with this secret, revoked or not; None if there is none."""
    return session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_secret(secret)))


def list_keys(session: Session) -> list[ApiKey]:
    return list(session.scalars(select(ApiKey).order_by(ApiKey.tenant, ApiKey.created_at)))


def revoke_key(session: Session, key_id: str) -> ApiKey | None:
    """Revoke a key from now on (revoking twice keeps the first time). None if no key has this id."""
    key = session.get(ApiKey, key_id)
    if key is not None and key.revoked_at is None:
        key.revoked_at = time.time()
    return key


def any_key_exists(session: Session) -> bool:
    """Whether keys are in use: once any key was made (even one since revoked), every call needs one."""
    return bool(session.scalar(select(exists().select_from(ApiKey))))
