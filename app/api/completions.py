"""POST /v1/completions and POST /v1/chat/completions: the OpenAI endpoints, waiting or streaming.

Each call becomes a Request row (its id is the completion id) and one `llmq.complete` task on the
model's queue. The answer is assembled from the request's Redis stream (llmq/streams.py), read from
its start, so tokens a worker made before we began reading are never lost.

A streaming client that goes away cancels its request: between tokens we send a heartbeat comment
about every second, and when the write fails (or the server closes the generator) we set the cancel
flag, so the worker frees the sequence at its next step. A waiting (non-streaming) client cannot be
watched that way under WSGI; its request runs to the end.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from flask import Blueprint, Response, jsonify, stream_with_context

from app import idempotency, limits
from app.api import common
from app.auth import current_tenant
from app.services import services
from app.sse import DONE, HEARTBEAT, sse_data
from app.stream_hub import StreamHub
from llmq.events import ErrorEvent, StreamProgress
from llmq.protocol.openai import new_id
from llmq.protocol.prepare import CHAT, COMPLETION, prepare
from llmq.protocol.responses import ChunkBuilder, ResponseSpec, error_reply, response_object
from llmq.store.models import TERMINAL_REQUEST_STATES, Request, RequestStatus
from llmq.streams import request_cancel

blueprint = Blueprint("completions", __name__, url_prefix="/v1")


@blueprint.post("/completions")
def create_completion():
    return answer(submit(COMPLETION, common.json_body()))


@blueprint.post("/chat/completions")
def create_chat_completion():
    return answer(submit(CHAT, common.json_body()))


# ---- submission (shared with the requests resource) ----------------------------------------

@dataclass(frozen=True)
class Submitted:
    spec: ResponseSpec  # how to assemble the answer from the request's events
    stream: bool  # the client asked for a stream
    row: Request  # the row as stored (detached): status "queued"


def submit(kind: str, body: dict) -> Submitted:
    """Prepare a completion or chat body (llmq/protocol/prepare.py), check it against the caller's
    limits, store it as a queued Request row of the caller's tenant, prepared request included, and
    enqueue its task. Raises APIError or InvalidRequest (both answered in the OpenAI error shape);
    nothing is stored or queued for a body that is refused."""
    model = common.check_model(body.get("model"))
    common.check_served(model)
    web = services()
    prepared = prepare(kind, body, web.tokenizer, web.model)
    params = prepared.params
    limits.check_max_tokens(params.max_tokens, "max_completion_tokens" if "max_completion_tokens" in body
                            else "max_tokens")
    caller = limits.current_limits()
    prepared.check_size(caller.max_request_choices, caller.max_request_tokens)
    # Charged at submission for what the request may use: its prompts and every choice's max_tokens.
    limits.charge_tokens(prepared.num_requested_tokens)

    request_id = new_id("chatcmpl-" if kind == CHAT else "cmpl-")
    with common.db().session() as session:
        row = Request(id=request_id, tenant=current_tenant(), kind=kind, model=model, body=body,
                      prepared=prepared.to_json(), status=RequestStatus.QUEUED)
        session.add(row)
    try:
        common.enqueue("llmq.complete", [request_id], model)
    except Exception:
        # The broker is unreachable: the row would wait forever for a task that was never sent.
        with common.db().session() as session:
            stored = session.get(Request, request_id)
            stored.status = RequestStatus.FAILED
            stored.error = {"code": "server_error", "message": "the request could not be queued (broker unreachable)"}
        raise
    return Submitted(prepared.response_spec(request_id, model, int(row.created_at)), prepared.stream, row)


# ---- answering -----------------------------------------------------------------------------

def answer(submitted: Submitted):
    idempotency.follow(submitted.spec, submitted.stream)  # a retry now answers from this same request
    return respond(submitted.spec, submitted.stream)


def respond(spec: ResponseSpec, stream: bool):
    """The answer to a submitted request, built from its events from the start: streamed or waited for."""
    if stream:
        return event_stream_response(completion_chunks(spec, common.redis_client(), common.stream_hub(),
                                                       common.tokenizer().token_text, common.settings().stream_ttl))
    return wait_for_response(spec)


def wait_for_response(spec: ResponseSpec):
    """Block until the request ends; the whole completion object, or its error in the OpenAI shape."""
    progress = StreamProgress()
    for _entry_id, event in common.stream_hub().read_events(spec.id):
        if event is not None:
            progress.add(event)
    if progress.error is not None and progress.error.code == "stream_incomplete":
        return stored_response(spec.id)  # the stream lost events: the result is whole in the database
    if progress.error is not None:
        status, body = error_reply(progress.error)
        return jsonify(body), status
    return response_object(spec, progress, common.tokenizer().token_text)


def stored_response(request_id: str, poll_s: float = 0.25):
    """The request's result as its worker stored it, once it has ended."""
    while True:
        with common.db().read() as session:
            row = session.get(Request, request_id)
            if row.status in TERMINAL_REQUEST_STATES:
                response, error = row.response, row.error
                break
        time.sleep(poll_s)
    if response is not None:
        return response
    event = (ErrorEvent(error["code"], error["message"], error.get("param")) if error
             else ErrorEvent("cancelled", "the request was cancelled before it started"))
    status, body = error_reply(event)
    return jsonify(body), status


def completion_chunks(spec: ResponseSpec, redis, hub: StreamHub, token_text, cancel_ttl: int):
    """The SSE text of a streamed completion. Cancels the request if the client leaves before the end."""
    builder = ChunkBuilder(spec, token_text)
    finished = False
    try:
        for chunk in builder.opening():
            yield sse_data(chunk)
        progress = StreamProgress()
        for _entry_id, event in hub.read_events(spec.id):
            if event is None:
                yield HEARTBEAT
                continue
            progress.add(event)
            for chunk in builder.chunks(event):
                yield sse_data(chunk)
        if progress.error is not None:
            yield sse_data(builder.error_chunk(progress.error))
        elif spec.include_usage and progress.usage is not None:
            yield sse_data(builder.usage_chunk(progress.usage))
        finished = True
        yield DONE
    finally:
        if not finished:  # GeneratorExit: the client went away (or the server is stopping)
            request_cancel(redis, spec.id, ttl=cancel_ttl)


def event_stream_response(chunks) -> Response:
    return Response(stream_with_context(chunks), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # no proxy buffering
