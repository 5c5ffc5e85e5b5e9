"""Every error in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

import logging

import kombu.exceptions
import redis
from flask import Flask, g, jsonify
from sqlalchemy import inspect
from sqlalchemy.exc import OperationalError, ProgrammingError
from werkzeug.exceptions import HTTPException

from app.services import services
from llmq.errors import InvalidRequest

try:  # the Procfile's server; the app runs under others too
    from gunicorn.http.errors import ParseException as _BodyParseError
except ImportError:
    _BodyParseError = None

log = logging.getLogger(__name__)

_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
REDIS_RETRY_AFTER_S = 5  # a restarted Redis is usually back, its data loaded, within seconds


class APIError(Exception):
    """An answer in the OpenAI error shape. `headers` go with it (Retry-After on a 429, for one)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 error_type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.error_type = error_type or _TYPES.get(status) or ("server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   error_type: str | None = None, headers: dict[str, str] | None = None):
    err = APIError(status, message, param, code, error_type)
    body = {"error": {"message": err.message, "type": err.error_type, "param": err.param, "code": err.code}}
    return jsonify(body), status, headers or {}


def excerpt(value, limit: int = 64) -> str:
    """What a client sent, as an error message quotes it: whole when short, else its start and its
    length (a 10 MB id is not echoed back)."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def not_found(kind: str, object_id: str) -> APIError:
    return APIError(404, f"No {kind} found with id '{excerpt(object_id)}'", param="id", code="not_found")


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(APIError)
    def _api_error(err: APIError):
        return error_response(err.status, err.message, err.param, err.code, err.error_type, err.headers)

    @app.errorhandler(InvalidRequest)
    def _invalid(err: InvalidRequest):
        return error_response(400, str(err), err.param, err.code)

    @app.errorhandler(HTTPException)
    def _http(err: HTTPException):
        messages = {
            404: "Not found: no such endpoint (see README for the API)",
            405: f"Method not allowed: {err.description}",
            413: f"The request is larger than this server accepts from you: uploads of at most "
                 f"{g.get('upload_limit') or services().settings.max_upload_bytes} bytes (LLMQ_MAX_UPLOAD_BYTES, "
                 "or your API key's own limit)",
        }
        message = messages.get(err.code, err.description)
        if err.code == 413:
            # The body was not read to its end: the connection cannot carry another request, so say so
            # (gunicorn closes it either way; saying keep-alive misled clients).
            return error_response(413, message, code="request_too_large", headers={"Connection": "close"})
        return error_response(err.code or 500, message)

    @app.errorhandler(redis.ConnectionError)  # BusyLoadingError (Redis still loading its data) among them
    @app.errorhandler(redis.TimeoutError)
    @app.errorhandler(kombu.exceptions.OperationalError)  # the broker refused a task
    def _redis_unavailable(err: Exception):
        log.warning("Redis is unavailable: %s", err)
        return error_response(503, "Redis (the task queue and the token streams) is unavailable or still loading; "
                                   f"try again in {REDIS_RETRY_AFTER_S} s", code="service_unavailable",
                              headers={"Retry-After": str(REDIS_RETRY_AFTER_S)})

    if _BodyParseError is not None:
        @app.errorhandler(_BodyParseError)
        def _unreadable_body(err: Exception):
            # gunicorn reads a chunked body as the app asks for it, so its chunk errors surface here;
            # what is left of the body cannot be parsed either, so the connection closes.
            return error_response(400, f"The request body could not be read: {excerpt(str(err), 200)}",
                                  code="invalid_request", headers={"Connection": "close"})

    @app.errorhandler(Exception)
    def _unexpected(err: Exception):
        log.exception("unhandled error")  # the traceback goes to the log, never to the client
        return error_response(500, "The server had an error while processing your request", code="server_error")

    @app.errorhandler(OperationalError)
    @app.errorhandler(ProgrammingError)
    def _database_error(err: Exception):
        # A web process started before the Procfile's release step (or without it) finds no tables:
        # say what to run, rather than a bare 500 on every request.
        if not _database_migrated():
            log.error("the database has not been migrated: run `python -m alembic upgrade head` (%s)", err)
            return error_response(503, "The server's database has not been migrated yet: its operator must run "
                                       "`python -m alembic upgrade head` (the Procfile's release step)",
                                  code="database_not_migrated")
        return _unexpected(err)


def _database_migrated() -> bool:
    """Whether Alembic has stamped the database (its alembic_version table exists); True when the
    database cannot even be asked, so a database that is down is not taken for an empty one."""
    try:
        return inspect(services().db.engine).has_table("alembic_version")
    except Exception:  # unreachable, or broken otherwise: the original error is the one to report
        return True
