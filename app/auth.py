"""Who is calling: the API key sent as `Authorization: Bearer llmq-...`, and the tenant it belongs to.

A fresh install has no keys and is open: every call runs as tenant "default", with no key. Once any
key exists, even a revoked one (revoking the last key must not open the server again), every call
but the health checks, GET /metrics and the dashboard's log-in page needs a valid, unrevoked key,
else 401 in the OpenAI shape saying what is wrong. `authenticate` runs before every request
(registered in create_app) and leaves the caller on flask.g: `g.tenant`, and `g.api_key` (the
ApiKey row, or None on an open install).

The key comes in the Authorization header, or, from a browser, in the dashboard's session (a key
entered once on its log-in page, app/web_session.py): then a state-changing call must also carry
the session's CSRF token, so another site cannot make the browser call with it.
"""
from __future__ import annotations

import threading

from flask import g, request

from app import web_session
from app.errors import APIError
from app.services import services
from llmq.store.api_keys import SECRET_PATTERN, any_key_exists, find_key
from llmq.store.database import Database
from llmq.store.models import DEFAULT_TENANT, ApiKey

# Every route of these blueprints is open: load balancers probe health and Prometheus scrapes metrics
# without a key. Everything else, the OpenAPI description included, is for key holders once keys
# exist (fetch it with yours).
PUBLIC_BLUEPRINTS = ("health", "metrics")
PUBLIC_ENDPOINTS = ("dashboard.login", "dashboard.static")  # where a person enters a key, and its style
NO_KEY_MESSAGE = ("You didn't provide an API key. This server requires one: send it in the Authorization header, "
                  "as 'Authorization: Bearer llmq-...'.")


def is_public() -> bool:
    return request.blueprint in PUBLIC_BLUEPRINTS or request.endpoint in PUBLIC_ENDPOINTS


def current_tenant() -> str:
    return g.tenant


def current_key() -> ApiKey | None:
    return g.get("api_key")


def authenticate() -> None:
    """before_request: set g.tenant and g.api_key, or raise 401."""
    if is_public():
        return
    web = services()
    database = web.db
    if not _keys_in_use(database, web.keys_seen):
        g.tenant, g.api_key = DEFAULT_TENANT, None
        return
    if "Authorization" not in request.headers and web_session.session_key_id() is not None:
        key = _session_key(database)
    else:
        key = key_for_secret(database, _bearer_secret())
    g.tenant, g.api_key = key.tenant, key


def key_for_secret(database: Database, secret: str) -> ApiKey:
    """The valid key with this secret, else 401 saying why."""
    if not SECRET_PATTERN.fullmatch(secret):
        raise unauthorized("Malformed API key: llmq keys look like 'llmq-' followed by 43 letters, digits, '-' "
                           "or '_' (as `llmq keys create` printed it).")
    with database.read() as session:
        key = find_key(session, secret)
    if key is None:
        raise unauthorized(f"Incorrect API key provided: {secret[:12]}... No key with this secret exists on "
                           "this server (keys are listed with `llmq keys list`).")
    _check_not_revoked(key)
    return key


def _session_key(database: Database) -> ApiKey:
    """The key of the browser's session, looked up anew (a revoked key ends the session), once the
    request's CSRF token checks out."""
    with database.read() as session:
        key = session.get(ApiKey, web_session.session_key_id())
    if key is None or key.revoked_at is not None:
        web_session.log_out()
    if key is None:
        raise unauthorized("Your session's API key no longer exists on this server: log in again with a key.")
    _check_not_revoked(key)
    problem = web_session.csrf_error()
    if problem:
        raise APIError(403, f"{problem} A call made with the dashboard's session cookie must carry its CSRF token "
                            f"(the {web_session.CSRF_HEADER} header or a csrf_token form field); reload the page "
                            "to get a fresh one.", code="csrf_failed")
    return key


def _check_not_revoked(key: ApiKey) -> None:
    if key.revoked_at is not None:
        raise unauthorized(f"The API key {key.display_prefix}... ({key.id}) has been revoked. Ask for a new key "
                           "(`llmq keys create --tenant ...`).")


def unauthorized(message: str) -> APIError:
    # OpenAI answers a bad key with type invalid_request_error and code invalid_api_key; clients match on those.
    return APIError(401, message, code="invalid_api_key", error_type="invalid_request_error",
                    headers={"WWW-Authenticate": 'Bearer realm="llmq"'})


def keys_in_use() -> bool:
    """Whether this server needs a key (any key was ever made)."""
    web = services()
    return _keys_in_use(web.db, web.keys_seen)


def _keys_in_use(database: Database, keys_seen: threading.Event) -> bool:
    """Keys are never deleted, so once any exists the answer stays yes: `keys_seen`, for the process.
    While none does, every call asks, so the first key (made by `llmq keys create`) closes the server at once."""
    if keys_seen.is_set():
        return True
    with database.read() as session:
        in_use = any_key_exists(session)
    if in_use:
        keys_seen.set()
    return in_use


def _bearer_secret() -> str:
    header = request.headers.get("Authorization")
    if not header:
        raise unauthorized(NO_KEY_MESSAGE)
    scheme, _, secret = header.partition(" ")
    secret = secret.strip()
    if scheme.lower() != "bearer" or not secret:
        raise unauthorized(f"Malformed Authorization header: it must be 'Bearer <key>', but its scheme is "
                           f"{scheme[:20]!r}{'' if secret else ' with no key after it'}.")
    return secret
