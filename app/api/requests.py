"""/v1/requests: one completion without holding a connection. Submit, then poll, follow or cancel.

- POST /v1/requests: a /v1/completions body, or a /v1/chat/completions body. The rule: a body with
  "messages" is a chat completion, one with "prompt" a completion; both at once is refused. Answers
  202 with the request object (status "queued") and a Location header. "stream" in the body changes
  nothing here: follow the tokens with the events endpoint.
- GET /v1/requests/{id}: status, timings (unix seconds), the text so far of every choice (from the
  token stream while running, from the stored response once completed), usage once done, the whole
  completion object once completed, the error once failed. Works for the ids /v1/completions made too.
- GET /v1/requests/{id}/events: Server-Sent Events, one per stream event (delta, done, error), each
  with its Redis stream entry id as the SSE id. Reconnect with Last-Event-ID (or ?last_event_id=) to
  get the rest and nothing twice. Ends after done or error; heartbeat comments while waiting. The
  request was made not to hold a connection, so a client that disconnects from here does not cancel
  it (it can reconnect and resume); pass ?cancel_on_disconnect=true to tie the request to this
  connection, as a streaming /v1/completions client's is. After the end, a client
  that already has the last event gets 204 (so EventSource stops reconnecting), and once the stream
  has expired (LLMQ_STREAM_TTL) 410: the result stays in GET /v1/requests/{id}.
- POST /v1/requests/{id}/cancel: sets the cancel flag (a running request stops at the worker's next
  step); a request still queued is marked cancelled at once. Answers the request object.
"""
from __future__ import annotations

import re
import time

from flask import Blueprint, Response, request, stream_with_context, url_for
from sqlalchemy import update

from app.api import common
from app.api.completions import submit
from app.errors import APIError, excerpt
from app.sse import HEARTBEAT, sse_event
from app.stream_hub import StreamHub
from llmq import events
from llmq.events import DeltaEvent, ErrorEvent, accumulate, stream_key
from llmq.protocol.prepare import CHAT, COMPLETION
from llmq.store.models import TERMINAL_REQUEST_STATES, Request, RequestStatus
from llmq.streams import entry_id_key, publish_events, request_cancel, stream_entry

blueprint = Blueprint("requests", __name__, url_prefix="/v1")

_ENDPOINTS = {COMPLETION: "/v1/completions", CHAT: "/v1/chat/completions"}
# Each part is below 2**64, so at most 20 digits: a longer one is refused before int() (which
# refuses over 4,300 digits with a ValueError, that was a 500).
_STREAM_ID = re.compile(r"^\d{1,20}(-\d{1,20})?$")
_MAX_STREAM_ID_PART = 1 << 64  # a Redis stream entry id is two unsigned 64-bit integers


@blueprint.post("/requests")
def create_request():
    body = common.json_body()
    if "messages" in body and "prompt" in body:
        raise APIError(400, "give either prompt (a completion) or messages (a chat completion), not both",
                       param="messages", code="invalid_request")
    submitted = submit(CHAT if "messages" in body else COMPLETION, body)
    location = url_for("requests.get_request", request_id=submitted.row.id)
    return request_object(submitted.row), 202, {"Location": location}


@blueprint.get("/requests/<request_id>")
def get_request(request_id: str):
    return request_object(_row(request_id))


@blueprint.post("/requests/<request_id>/cancel")
def cancel_request(request_id: str):
    row = _row(request_id)
    if row.status not in TERMINAL_REQUEST_STATES:
        redis, settings = common.redis_client(), common.settings()
        request_cancel(redis, request_id, ttl=settings.stream_ttl)
        # Only a row still queued is ours to end; a running one is the worker's, which aborts it and
        # stores what was made. The condition makes a race with a task starting it harmless.
        with common.db().session() as session:
            result = session.execute(update(Request).where(Request.id == request_id,
                                                           Request.status == RequestStatus.QUEUED)
                                     .values(status=RequestStatus.CANCELLED, finished_at=time.time()))
        if result.rowcount:
            # The task will skip this row without publishing: end the stream here for whoever follows it.
            event = ErrorEvent("cancelled", "the request was cancelled before it started", t=time.time())
            publish_events(redis, request_id, [event], settings.stream_maxlen, settings.stream_ttl)
        row = _row(request_id)
    return request_object(row)


@blueprint.get("/requests/<request_id>/events")
def request_events(request_id: str):
    row = _row(request_id)
    last_id = request.headers.get("Last-Event-ID") or request.args.get("last_event_id") or "0-0"
    if not _STREAM_ID.match(last_id):
        raise APIError(400, f"Last-Event-ID must be a stream entry id such as 0-12 (the id of the last event received), got {excerpt(last_id)!r}",
                       param="last_event_id", code="invalid_request")
    if max(entry_id_key(last_id)) >= _MAX_STREAM_ID_PART:  # Redis refuses such an id: that was a 500
        raise APIError(400, f"Last-Event-ID {last_id!r} is past any stream entry id (each part is below 2**64)",
                       param="last_event_id", code="invalid_request")
    cancel_on_disconnect = request.args.get("cancel_on_disconnect", "false").lower() in ("true", "1", "yes")
    redis = common.redis_client()
    last_entry = redis.xrevrange(stream_key(request_id), count=1)
    if last_entry:
        entry_id, data = stream_entry(last_entry[0])
        if not isinstance(events.decode(data), DeltaEvent) and entry_id_key(entry_id) <= entry_id_key(last_id):
            return Response(status=204)  # the client has everything, the end included
    elif row.status in TERMINAL_REQUEST_STATES:
        raise APIError(410, f"the event stream of request {request_id} has expired; its result is at "
                            f"GET /v1/requests/{request_id}", code="stream_expired")
    stream = _event_stream(redis, common.stream_hub(), request_id, last_id,
                           common.settings().stream_ttl if cancel_on_disconnect else None)
    return Response(stream_with_context(stream), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _event_stream(redis, hub: StreamHub, request_id: str, last_id: str, cancel_ttl: int | None):
    finished = False
    try:
        for entry_id, event in hub.read_events(request_id, last_id=last_id):
            if event is None:
                yield HEARTBEAT
                continue
            if not isinstance(event, DeltaEvent):
                finished = True  # whatever happens to this connection now, the request is over
            yield sse_event(entry_id, event)
        finished = True
    finally:
        if not finished and cancel_ttl is not None:  # the client went away while the request ran
            request_cancel(redis, request_id, ttl=cancel_ttl)


# ---- the request object --------------------------------------------------------------------

def request_object(row: Request) -> dict:
    """The request as now known. Choices come from the stored response once there is one, else from
    the token stream (text so far); usage from the response or, just before it is stored, the done event.
    Finish reasons are the engine's own: a cancelled choice says "abort" (the OpenAI answer says "stop")."""
    usage = None
    if row.response is not None:
        choices = [{"index": c["index"], "text": c["message"]["content"] if "message" in c else c["text"],
                    "finish_reason": c["finish_reason"]} for c in row.response.get("choices", [])]
        usage = row.response.get("usage")
        error = row.error
    else:
        progress = accumulate(_stream_events(row.id))
        choices = [{"index": i, "text": c.text, "finish_reason": c.finish_reason}
                   for i, c in sorted(progress.choices.items())]
        usage = progress.usage.as_dict() if progress.usage is not None else None
        error = row.error or (progress.error.as_dict() if progress.error is not None else None)
    return {
        "id": row.id, "object": "request", "status": row.status, "model": row.model,
        "endpoint": _ENDPOINTS.get(row.kind, "/v1/completions"),
        "created_at": row.created_at, "started_at": row.started_at, "first_token_at": row.first_token_at,
        "finished_at": row.finished_at,
        "text": choices[0]["text"] if choices else "",
        "choices": choices, "usage": usage,
        "response": row.response if row.status == RequestStatus.COMPLETED else None,
        "error": error,
    }


def _stream_events(request_id: str) -> list[events.Event]:
    """Every event in the request's stream now, without waiting (empty once the stream expired)."""
    entries = common.redis_client().xrange(stream_key(request_id))
    return [events.decode(data) for _entry_id, data in map(stream_entry, entries)]


def _row(request_id: str) -> Request:
    """The caller's request (404 for another tenant's, as for an unknown id). Every route here reads
    a request's Redis stream only after this check: the stream is reached only through its row."""
    with common.db().read() as session:  # polled often: it waits for no writer
        return common.owned(session, Request, request_id, "request")
