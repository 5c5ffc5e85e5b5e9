"""POST /v1/completions and POST /v1/chat/completions: the OpenAI endpoints, waiting or streaming.

Each call becomes a Request row (its id is the completion id) and one `llmq.complete` task on the
model's queue. The answer is assembled from the request's Redis stream (app/streams.py), read from
its start, so tokens a worker made before we began reading are never lost.

A streaming client that goes away cancels its request: between tokens we send a heartbeat comment
about every second, and when the write fails (or the server closes the generator) we set the cancel
flag, so the worker frees the sequence at its next step. A waiting (non-streaming) client cannot be
watched that way under WSGI; its request runs to the end.
"""
from __future__ import annotations

from dataclasses import dataclass

from flask import Blueprint, Response, current_app, jsonify, stream_with_context

from app import completion_stream, idempotency, limits
from app.api import common
from app.auth import current_tenant
from app.completion_stream import ChunkBuilder, ResponseSpec, StreamState
from app.errors import APIError
from app.models import Request, new_id
from app.stream_hub import StreamHub
from app.streams import request_cancel
from workers.engine.config import InvalidRequest
from workers.model.model_config import ModelConfig
from workers.model.tokenizer import TokenizerError
from workers.openai_protocol import parse_chat_request, parse_completion_request

blueprint = Blueprint("completions", __name__, url_prefix="/v1")


@blueprint.post("/completions")
def create_completion():
    return answer(submit("completion", common.json_body()))


@blueprint.post("/chat/completions")
def create_chat_completion():
    return answer(submit("chat", common.json_body()))


# ---- submission (shared with the requests resource) ----------------------------------------

@dataclass(frozen=True)
class Submitted:
    spec: ResponseSpec  # how to assemble the answer from the request's events
    stream: bool  # the client asked for a stream
    row: Request  # the row as stored (detached): status "queued"


def submit(kind: str, body: dict) -> Submitted:
    """Validate a completion or chat body, check it against the caller's limits, store it as a queued
    Request row of the caller's tenant and enqueue its task. Raises APIError or InvalidRequest (both
    answered in the OpenAI error shape); nothing is stored or queued for a body that is refused."""
    model = common.check_model(body.get("model"))
    tokenizer = common.tokenizer()
    if kind == "chat":
        chat = parse_chat_request(body)
        params, stream, include_usage, echo = chat.params, chat.stream, chat.include_usage, False
        prompt_ids = [_chat_prompt_ids(model, tokenizer, chat.messages)]
    else:
        completion = parse_completion_request(body)
        params, stream, include_usage, echo = (completion.params, completion.stream, completion.include_usage,
                                               completion.echo)
        prompt_ids = [tokenizer.encode(p) if isinstance(p, str) else p for p in completion.prompts]
    limits.check_max_tokens(params.max_tokens, "max_completion_tokens" if "max_completion_tokens" in body
                            else "max_tokens")
    _check_fits(prompt_ids, params.max_tokens, params.n)
    # Charged at submission for what the request may use: its prompts and every choice's max_tokens.
    limits.charge_tokens(sum(len(ids) for ids in prompt_ids) + params.max_tokens * params.n * len(prompt_ids))

    request_id = new_id("chatcmpl-" if kind == "chat" else "cmpl-")
    with common.db().session() as session:
        row = Request(id=request_id, tenant=current_tenant(), kind=kind, model=model, body=body, status="queued")
        session.add(row)
    try:
        common.enqueue("llmq.complete", [request_id], model)
    except Exception:
        # The broker is unreachable: the row would wait forever for a task that was never sent.
        with common.db().session() as session:
            stored = session.get(Request, request_id)
            stored.status = "failed"
            stored.error = {"code": "server_error", "message": "the request could not be queued (broker unreachable)"}
        raise
    spec = ResponseSpec(
        id=request_id, kind=kind, model=model, created=int(row.created_at), num_choices=len(prompt_ids) * params.n,
        n=params.n, logprobs=params.logprobs is not None, include_usage=include_usage,
        echo_prefixes=tuple(tokenizer.decode(ids) for ids in prompt_ids) if echo else ())
    return Submitted(spec, stream, row)


def _chat_prompt_ids(model: str, tokenizer, messages: list[dict]) -> list[int]:
    """The rendered chat prompt's token ids, as the worker will make them (workers/completion_runner.py)."""
    if tokenizer.chat_template is None:
        raise APIError(400, f"model {model} has no chat template, so it cannot serve /v1/chat/completions; "
                            "use /v1/completions with a plain prompt, or serve a model whose tokenizer_config.json "
                            "(or chat_template.jinja) has a chat_template", param="model", code="no_chat_template")
    try:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except TokenizerError as err:  # e.g. the template raises on a role order it does not support
        raise InvalidRequest(f"the model's chat template rejected the messages: {err}", "messages") from None
    return tokenizer.encode(rendered, add_special_tokens=False)


def _check_fits(prompt_ids: list[list[int]], max_tokens: int, n: int) -> None:
    """Refuse now what the engine would surely refuse later, with the same words. The engine's own
    context can be shorter still (a small KV cache); it says so in the request's error event."""
    config = _model_config()
    settings = common.settings()
    if n > settings.max_num_seqs:
        raise InvalidRequest(f"n is {n}, more samples than this server runs at once "
                             f"(max_num_seqs {settings.max_num_seqs})", "n")
    context = min(config.max_position_embeddings, config.sliding_window or config.max_position_embeddings)
    for ids in prompt_ids:
        bad = next((t for t in ids if not 0 <= t < config.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary (0..{config.vocab_size - 1})", "prompt")
        if len(ids) >= context:
            raise InvalidRequest(f"prompt is {len(ids)} tokens; this model's context is {context} tokens, "
                                 "including the completion", "prompt")
        if len(ids) + max_tokens > context:
            raise InvalidRequest(f"prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds this model's "
                                 f"context of {context} tokens", "max_tokens")


def _model_config() -> ModelConfig:
    config = current_app.extensions.get("llmq_model_config")
    if config is None:
        config = current_app.extensions["llmq_model_config"] = ModelConfig.from_folder(
            common.settings().resolved_model_path())
    return config


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
    state = StreamState()
    for _entry_id, event in common.stream_hub().read_events(spec.id):
        if event is not None:
            state.add(event)
    if state.error is not None:
        status, body = completion_stream.error_reply(state.error)
        return jsonify(body), status
    return completion_stream.response_object(spec, state, common.tokenizer().token_text)


def completion_chunks(spec: ResponseSpec, redis, hub: StreamHub, token_text, cancel_ttl: int):
    """The SSE text of a streamed completion. Cancels the request if the client leaves before the end."""
    builder = ChunkBuilder(spec, token_text)
    finished = False
    try:
        for chunk in builder.opening():
            yield completion_stream.sse_data(chunk)
        state = StreamState()
        for _entry_id, event in hub.read_events(spec.id):
            if event is None:
                yield completion_stream.HEARTBEAT
                continue
            state.add(event)
            for chunk in builder.chunks(event):
                yield completion_stream.sse_data(chunk)
        if state.error is not None:
            yield completion_stream.sse_data(builder.error_chunk(state.error))
        elif spec.include_usage and state.usage is not None:
            yield completion_stream.sse_data(builder.usage_chunk(state.usage))
        finished = True
        yield completion_stream.DONE
    finally:
        if not finished:  # GeneratorExit: the client went away (or the server is stopping)
            request_cancel(redis, spec.id, ttl=cancel_ttl)


def event_stream_response(chunks) -> Response:
    return Response(stream_with_context(chunks), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # no proxy buffering
