"""The OpenAPI 3.1 description of every llmq endpoint, served at GET /openapi.json.

Plain data, built once per process. tests/api/test_openapi_spec.py checks that every Flask route is
described here (so a new endpoint without docs fails) and that the document is valid OpenAPI;
tests/service/test_fuzz_openapi.py fuzzes the running service against it.
"""
from __future__ import annotations

from functools import cache

from app.openapi_schemas import SCHEMAS, ref

OPENAPI_VERSION = "3.1.0"

# ---- shared parts --------------------------------------------------------------------------


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(description: str) -> dict:
    return _json(ref("Error"), description)


def _errors(*statuses: int) -> dict:
    return {str(status): {"$ref": f"#/components/responses/{_ERROR_RESPONSES[status]}"} for status in statuses}


_ERROR_RESPONSES = {400: "BadRequest", 401: "Unauthorized", 404: "NotFound", 409: "IdempotencyInProgress",
                    413: "TooLarge", 422: "IdempotencyKeyReused", 429: "RateLimited", 503: "Unavailable"}

RESPONSES = {
    "BadRequest": _error("The request is invalid; `param` names the field and `message` says what is wrong."),
    "Unauthorized": _error("No valid API key (code `invalid_api_key`; the message says whether it is missing, "
                           "malformed, unknown or revoked): send `Authorization: Bearer <key>`."),
    "NotFound": _error("No such object (or model); `param` names what was looked up."),
    "TooLarge": _error("The upload is larger than this server accepts (LLMQ_MAX_UPLOAD_BYTES)."),
    "RateLimited": {**_error("Too many requests for this key (rate_limit_error); retry after `Retry-After` seconds."),
                    "headers": {"Retry-After": {"description": "seconds to wait before retrying",
                                                "schema": {"type": "integer", "minimum": 0}}}},
    "Unavailable": {**_error("Redis (the task queue and the token streams) is unavailable; retry after "
                             "`Retry-After` seconds."),
                    "headers": {"Retry-After": {"description": "seconds to wait before retrying",
                                                "schema": {"type": "integer"}}}},
    "IdempotencyInProgress": {
        **_error("The first request with this Idempotency-Key is still being handled "
                 "(`idempotency_request_in_progress`); retry after `Retry-After` seconds to get its answer."),
        "headers": {"Retry-After": {"description": "seconds to wait before retrying",
                                    "schema": {"type": "integer", "minimum": 0}}}},
    "IdempotencyKeyReused": _error("This Idempotency-Key was used for a different request (method, path or body) "
                                   "in the last 24 hours (`idempotency_key_reused`)."),
}

PARAMETERS = {
    "IdempotencyKey": {
        "name": "Idempotency-Key", "in": "header", "required": False,
        "schema": {"type": "string", "minLength": 1, "maxLength": 255},
        "description": "A client-chosen key (printable, at most 255 characters): a POST repeated with the same key "
                       "and the same body within 24 hours answers as the first one did (header "
                       "`Idempotent-Replayed: true`), without doing the work twice."},
}

_IDEMPOTENCY_KEY = {"$ref": "#/components/parameters/IdempotencyKey"}


def _path_id(name: str, example: str) -> dict:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}, "example": example}


def _operation(operation_id: str, summary: str, responses: dict, *, tag: str, method: str = "get",
               body: dict | None = None, parameters: list | None = None, errors: tuple = (), public: bool = False,
               description: str | None = None) -> dict:
    """One operation. Every operation may answer 401, 429 and 503 (API keys, rate limits, Redis away),
    except the public ones (health, metrics); every POST takes an optional Idempotency-Key."""
    op = {"operationId": operation_id, "summary": summary, "tags": [tag]}
    if description:
        op["description"] = description
    params = list(parameters or [])
    if method == "post":
        params.append(_IDEMPOTENCY_KEY)
        # a malformed key; the first attempt still running; the key already used for another request
        errors = (*errors, 400, 409, 422)
    if params:
        op["parameters"] = params
    if body is not None:
        op["requestBody"] = body
    all_errors = errors if public else (*errors, 401, 429, 503)  # 503: Redis is away (Retry-After)
    # An operation's own description of a status (e.g. a cancelled completion's 409) stays.
    op["responses"] = {**_errors(*sorted(set(all_errors) - {int(status) for status in responses})), **responses}
    if public:
        op["security"] = []
    return op


def _json_body(name: str) -> dict:
    return {"required": True, "content": {"application/json": {"schema": ref(name)}}}


_STREAM_ENTRY_ID = {"type": "string", "pattern": r"^(\d{1,20}(-\d{1,20})?)?$"}  # a Redis stream entry id, or empty


def _sse(event: str) -> dict:
    return {"text/event-stream": {"schema": ref(event)}}

# ---- the operations ------------------------------------------------------------------------


def _completion_operation(operation_id: str, summary: str, request: str, answer: str, chunk: str) -> dict:
    return _operation(
        operation_id, summary, method="post", tag="completions", body=_json_body(request), errors=(400, 404),
        description=("Waits for the whole answer, or with `stream: true` answers Server-Sent Events: one "
                     f"`data: {{{chunk} JSON}}` per token delta, a usage chunk when `stream_options.include_usage`, "
                     "then `data: [DONE]`. A failure while streaming arrives as one `data: {error object}`. "
                     "A streaming client that disconnects cancels its request."),
        responses={
            "200": {"description": f"The {answer} (or, when streaming, its chunks)",
                    "content": {"application/json": {"schema": ref(answer)}, **_sse("CompletionStreamEvent")}},
            "409": _error("The request was cancelled before it ran (code `cancelled`)."),
            "500": _error("The worker failed while running the request (server_error)."),
        })


PATHS = {
    "/health": {"get": _operation(
        "health", "Liveness for load balancers (no key needed)", tag="service", public=True,
        responses={"200": _json({"type": "object", "required": ["status"],
                                 "properties": {"status": {"const": "ok"}}}, "The web process is up")})},
    "/metrics": {"get": _operation(
        "metrics", "The whole fleet's metrics, for Prometheus (no key needed)", tag="service", public=True,
        errors=(503,),
        description=("The Prometheus text format: every live worker's load, token counters and latency "
                     "histograms (vLLM's names under `llmq:`), each model's queue depth, workers by state, "
                     "the autoscaler's decisions, batches and batch lines by status. See llmq/metrics.py."),
        responses={"200": {"description": "The metrics",
                           "content": {"text/plain": {"schema": {"type": "string"}}}}})},
    "/openapi.json": {"get": _operation(
        "openapi", "This OpenAPI description (a key is needed once keys exist, as everywhere but health and metrics)",
        tag="service",
        responses={"200": _json({"type": "object", "required": ["openapi", "paths"]}, "The OpenAPI 3.1 document")})},
    "/v1/models": {"get": _operation(
        "listModels", "The served model", tag="models", responses={"200": _json(ref("ModelList"), "The models")})},
    "/v1/models/{model_id}": {"get": _operation(
        "getModel", "One model", tag="models", parameters=[_path_id("model_id", "stories260k")], errors=(404,),
        responses={"200": _json(ref("Model"), "The model")})},
    "/v1/completions": {"post": _completion_operation(
        "createCompletion", "A completion of one or more prompts", "CompletionRequest", "Completion",
        "text_completion")},
    "/v1/chat/completions": {"post": _completion_operation(
        "createChatCompletion", "A chat completion", "ChatCompletionRequest", "ChatCompletion",
        "chat.completion.chunk")},
    "/v1/requests": {"post": _operation(
        "createRequest", "Submit one completion without holding a connection", method="post", tag="requests",
        description=("A /v1/completions body (with `prompt`) or a /v1/chat/completions body (with `messages`), "
                     "not both. `stream` changes nothing here: follow the tokens at /v1/requests/{id}/events."),
        body={"required": True, "content": {"application/json": {"schema": {
            "anyOf": [ref("CompletionRequest"), ref("ChatCompletionRequest")]}}}},
        errors=(400, 404),
        responses={"202": {**_json(ref("Request"), "Queued"), "headers": {"Location": {
            "description": "where to poll it", "schema": {"type": "string"}}}}})},
    "/v1/requests/{request_id}": {"get": _operation(
        "getRequest", "A request's status, timings, text so far and answer", tag="requests",
        parameters=[_path_id("request_id", "cmpl-0123456789abcdef01234567")], errors=(404,),
        responses={"200": _json(ref("Request"), "The request")})},
    "/v1/requests/{request_id}/cancel": {"post": _operation(
        "cancelRequest", "Cancel a request (a running one stops at the worker's next step)", method="post",
        tag="requests", parameters=[_path_id("request_id", "cmpl-0123456789abcdef01234567")], errors=(404,),
        responses={"200": _json(ref("Request"), "The request after the cancel")})},
    "/v1/requests/{request_id}/events": {"get": _operation(
        "getRequestEvents", "A request's token events as Server-Sent Events (resumable)", tag="requests",
        description=("One SSE event per stream event (`event: delta|done|error`, `id:` the Redis stream entry id, "
                     "`data:` the event JSON), ending after done or error; heartbeat comments while waiting. "
                     "Reconnect with Last-Event-ID to get the rest and nothing twice."),
        parameters=[_path_id("request_id", "cmpl-0123456789abcdef01234567"),
                    {"name": "Last-Event-ID", "in": "header", "required": False, "schema": _STREAM_ENTRY_ID,
                     "description": ("the id of the last event received (empty: from the first event); "
                                     "each part is below 2**64")},
                    {"name": "last_event_id", "in": "query", "required": False, "schema": _STREAM_ENTRY_ID,
                     "description": "the same, for clients that cannot set headers"},
                    {"name": "cancel_on_disconnect", "in": "query", "required": False,
                     "schema": {"type": "string", "default": "false"},
                     "description": "`true` (or `1`, `yes`): a client that disconnects cancels the request"}],
        errors=(400, 404),
        responses={"200": {"description": "The events", "content": _sse("RequestStreamEvent")},
                   "204": {"description": "The client already has every event, the end included"},
                   "410": _error("The event stream has expired; the result stays at GET /v1/requests/{id}")})},
    "/v1/files": {
        "post": _operation(
            "uploadFile", "Upload a batch input file (JSON Lines)", method="post", tag="files", errors=(400, 413),
            body={"required": True, "content": {"multipart/form-data": {"schema": ref("FileUpload")}}},
            responses={"200": _json(ref("File"), "The stored file")}),
        "get": _operation(
            "listFiles", "Every file not deleted, newest first", tag="files",
            parameters=[{"name": "purpose", "in": "query", "required": False, "schema": {"type": "string"},
                         "description": "only files with this purpose (batch, batch_output)"}],
            responses={"200": _json(ref("FileList"), "The files (one page: has_more is false)")}),
    },
    "/v1/files/{file_id}": {
        "get": _operation("getFile", "One file's metadata", tag="files", errors=(404,),
                          parameters=[_path_id("file_id", "file-0123456789abcdef01234567")],
                          responses={"200": _json(ref("File"), "The file")}),
        "delete": _operation("deleteFile", "Delete a file (it answers 404 from then on)", tag="files", errors=(404,),
                             parameters=[_path_id("file_id", "file-0123456789abcdef01234567")],
                             responses={"200": _json(ref("FileDeleted"), "Deleted")}),
    },
    "/v1/files/{file_id}/content": {"get": _operation(
        "getFileContent", "A file's bytes: the uploaded input, or a batch's output or error JSON Lines", tag="files",
        parameters=[_path_id("file_id", "file-0123456789abcdef01234567")], errors=(404,),
        responses={"200": {"description": "The raw bytes (JSON Lines, one object per line)",
                           "content": {"application/octet-stream": {"schema": {"type": "string",
                                                                               "format": "binary"}}}}})},
    "/v1/batches": {
        "post": _operation(
            "createBatch", "Create a batch from an uploaded file", method="post", tag="batches",
            body=_json_body("BatchCreateRequest"), errors=(400, 404, 503),
            description="Every bad input line becomes one error line of the batch's error file, never a failed batch.",
            responses={"200": _json(ref("Batch"), "The batch (status validating)")}),
        "get": _operation(
            "listBatches", "Batches, newest first, a page at a time", tag="batches", errors=(400,),
            parameters=[{"name": "after", "in": "query", "required": False, "schema": {"type": "string"},
                         "description": "the last_id of the previous page"},
                        {"name": "limit", "in": "query", "required": False,
                         "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}}],
            responses={"200": _json(ref("BatchList"), "One page of batches")}),
    },
    "/v1/batches/{batch_id}": {"get": _operation(
        "getBatch", "One batch, with live request_counts", tag="batches", errors=(404,),
        parameters=[_path_id("batch_id", "batch_0123456789abcdef01234567")],
        responses={"200": _json(ref("Batch"), "The batch")})},
    "/v1/batches/{batch_id}/cancel": {"post": _operation(
        "cancelBatch", "Cancel a validating or in_progress batch", method="post", tag="batches", errors=(400, 404),
        parameters=[_path_id("batch_id", "batch_0123456789abcdef01234567")],
        responses={"200": _json(ref("Batch"), "The batch, cancelling or cancelled")})},
    "/v1/workers": {"get": _operation(
        "listWorkers", "The workers' latest heartbeats", tag="service",
        responses={"200": _json(ref("WorkerList"), "Live workers: model, running, waiting, free and total KV blocks")})},
}


@cache
def openapi_document() -> dict:
    """The whole document. Built once; callers must not change it."""
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "llmq",
            "version": "0.1.0",
            "description": ("Self-hosted batch LLM inference with an OpenAI-compatible API. Every error has the "
                            "OpenAI shape `{\"error\": {\"message\", \"type\", \"param\", \"code\"}}`. A server "
                            "with API keys answers 401 without a valid `Authorization: Bearer <key>`; a server "
                            "with no keys configured is open."),
        },
        "security": [{"bearerAuth": []}],
        "paths": PATHS,
        "components": {
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer",
                                               "description": "an llmq API key"}},
            "schemas": SCHEMAS,
            "responses": RESPONSES,
            "parameters": PARAMETERS,
        },
    }
