"""`Idempotency-Key` on POST: a retried submission gets the first attempt's answer, never a second job.

A client that lost an answer (a dropped connection, a timeout) sends the same POST again with the same
Idempotency-Key header. The first attempt is remembered in Redis at llmq:idem:{tenant}:{key} for 24 h
(keys are per tenant, so two tenants never collide), with a fingerprint of the request (method, path
and body), in one of three states:

  running     the first attempt is being handled: a duplicate now gets 409
              idempotency_request_in_progress, with Retry-After (the openai client retries 409s)
  following   the first attempt made completion request `spec.id` and is waiting for or streaming it:
              a duplicate follows the same request (the stream replayed from Redis from its start)
  done        the first attempt's answer (status, body, Content-Type, Location), replayed as it was

A replayed answer carries `Idempotent-Replayed: true`. The same key with a different request is 422
idempotency_key_reused. A first attempt that was refused or failed (4xx, 5xx) is forgotten, so its
retry runs anew. Registered on the app by `init_app`, after authentication and the request rate limit.
"""
from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import asdict, dataclass

import redis
from flask import Flask, Response, current_app, g, request

from app.auth import current_tenant, is_public
from app.errors import APIError
from app.services import services
from llmq.protocol.responses import ResponseSpec

HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
TTL_SECONDS = 24 * 3600
# How long a first attempt may run before a duplicate may start over: it bounds how long a crashed
# web process blocks retries. Any attempt that made a completion request switches to "following" (24 h).
RUNNING_TTL_SECONDS = 600
MAX_KEY_CHARS = 255
REPLAYED_HEADERS = ("Content-Type", "Location")

# Write the record only if it is still this attempt's: an attempt whose "running" record expired
# (and was taken over by a retry) must not overwrite the retry's. An empty value deletes.
_UPDATE_OWN_RECORD = """
local current = redis.call('GET', KEYS[1])
if not current or cjson.decode(current)['attempt'] ~= ARGV[1] then return 0 end
if ARGV[2] == '' then redis.call('DEL', KEYS[1]) else redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3]) end
return 1
"""


@dataclass(frozen=True)
class Claim:
    """This request is the first attempt under its key (kept on flask.g while it runs)."""

    redis_key: str
    attempt: str
    fingerprint: str


def init_app(app: Flask) -> None:
    app.before_request(begin)
    app.after_request(finish)


def begin() -> Response | None:
    """before_request: claim the key for this attempt, or answer a duplicate."""
    if request.method != "POST" or is_public() or HEADER not in request.headers:
        return None
    redis_key = f"llmq:idem:{current_tenant()}:{_idempotency_key()}"
    fingerprint = _fingerprint()
    claim = Claim(redis_key, uuid.uuid4().hex, fingerprint)
    running = json.dumps({"state": "running", "attempt": claim.attempt, "fingerprint": fingerprint})
    for _ in range(3):  # the record can expire between the two commands: then claim it again
        if _redis().set(redis_key, running, nx=True, ex=RUNNING_TTL_SECONDS):
            g.idempotency_claim = claim
            return None
        stored = _redis().get(redis_key)
        if stored is not None:
            return _answer_duplicate(json.loads(stored), fingerprint)
    raise _in_progress()


def follow(spec: ResponseSpec, stream: bool) -> None:
    """Called when an attempt has stored completion request `spec.id` and starts answering from its
    events: a duplicate from now on answers from the same request. No-op without an Idempotency-Key."""
    claim: Claim | None = g.get("idempotency_claim")
    if claim is not None:
        # Kept no longer than the request's stream may live: a duplicate follows that stream.
        ttl = min(TTL_SECONDS, services().settings.stream_ttl)
        _update_own_record(claim, {"state": "following", "spec": asdict(spec), "stream": stream}, ttl)


def finish(response: Response) -> Response:
    """after_request: keep the first attempt's answer, or forget a refused or failed attempt."""
    claim: Claim | None = g.pop("idempotency_claim", None)
    if claim is None:
        return response
    if response.status_code >= 400:
        _update_own_record(claim, None)
    elif not response.is_streamed:  # a streamed answer is already "following" its request
        _update_own_record(claim, {"state": "done", "status": response.status_code,
                                   "body": response.get_data(as_text=True),
                                   "headers": {name: response.headers[name] for name in REPLAYED_HEADERS
                                               if name in response.headers}})
    return response


def _answer_duplicate(record: dict, fingerprint: str) -> Response:
    if record["fingerprint"] != fingerprint:
        raise APIError(422, f"Idempotency-Key {request.headers[HEADER]!r} was already used for a different "
                            "request (method, path or body) in the last 24 hours: send a new key with a new "
                            "request", param=None, code="idempotency_key_reused")
    if record["state"] == "running":
        raise _in_progress()
    if record["state"] == "following":
        from app.api.completions import respond  # the completions module calls follow(): imported late

        spec = record["spec"]
        response = respond(ResponseSpec(**{**spec, "echo_prefixes": tuple(spec["echo_prefixes"])}), record["stream"])
        response = current_app.make_response(response)
    else:
        response = Response(record["body"], status=record["status"], headers=record["headers"])
    response.headers[REPLAYED_HEADER] = "true"
    return response


def _in_progress() -> APIError:
    return APIError(409, f"a request with Idempotency-Key {request.headers[HEADER]!r} is still being handled; "
                         "retry after it has finished to get its answer", code="idempotency_request_in_progress",
                    headers={"Retry-After": "1"})


def _update_own_record(claim: Claim, fields: dict | None, ttl: int = TTL_SECONDS) -> None:
    value = "" if fields is None else json.dumps({**fields, "attempt": claim.attempt,
                                                  "fingerprint": claim.fingerprint})
    _redis().register_script(_UPDATE_OWN_RECORD)(keys=[claim.redis_key], args=[claim.attempt, value, ttl])


def _idempotency_key() -> str:
    key = request.headers[HEADER]
    if not 1 <= len(key) <= MAX_KEY_CHARS or not key.isprintable():
        raise APIError(400, f"the {HEADER} header must be 1 to {MAX_KEY_CHARS} printable characters "
                            "(a UUID is a good choice)", code="invalid_idempotency_key")
    return key


def _fingerprint() -> str:
    """What makes two POSTs the same request: method, path and query, and the body's content."""
    digest = hashlib.sha256(f"{request.method} {request.full_path}\n".encode())
    if request.mimetype == "multipart/form-data":
        # Every attempt has its own random multipart boundary, so compare the parts, not the bytes. A part
        # whose name werkzeug cannot read has the name None, so the parts are sorted by their JSON.
        for name, value in sorted(request.form.items(multi=True), key=json.dumps):
            digest.update(json.dumps(["field", name, value]).encode())
        for name, upload in sorted(request.files.items(multi=True), key=lambda item: json.dumps(item[0])):
            content = upload.stream.read()
            upload.stream.seek(0)  # the view reads it again
            digest.update(json.dumps(["file", name, upload.filename, hashlib.sha256(content).hexdigest()]).encode())
    elif (body := request.get_json(silent=True)) is not None:
        # Parsed, so key order and spacing do not make a retry look like a new request.
        digest.update(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    else:
        digest.update(request.get_data())
    return digest.hexdigest()


def _redis() -> redis.Redis:
    return services().redis
