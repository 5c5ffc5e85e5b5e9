"""The JSON Schemas (OpenAPI 3.1, so plain JSON Schema 2020-12) of what llmq reads and writes.

Request bodies carry the constraints the validators enforce (llmq/protocol/openai.py,
llmq/sampling_params.py, app/api/*.py; their numbers from llmq/limits.py), so a client generated
from the document is refused for the same reasons the server refuses it. What a schema cannot say (a prompt plus
max_tokens must fit the served model's context; n at most the server's max_num_seqs) is said in the
field's description and answered with a 400 naming the field.
"""
from __future__ import annotations

from llmq.limits import MAX_LOGPROBS, MAX_N, MAX_STOP_SEQUENCES


def ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


_UNIX_SECONDS = {"type": "integer", "description": "unix time, whole seconds"}
_UNIX_SECONDS_OR_NULL = {"type": ["integer", "null"], "description": "unix time, whole seconds; null until then"}
_UNIX_TIME_OR_NULL = {"type": ["number", "null"], "description": "unix time, seconds (fractional); null until then"}
_TOKEN_ID = {"type": "integer", "minimum": 0, "description": "a token id, below the model's vocabulary size"}
_NON_EMPTY_STRING = {"type": "string", "minLength": 1}

ERROR = {
    "type": "object",
    "description": "Every non-2xx answer. `param` names the offending field where there is one.",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "additionalProperties": False,
        "properties": {
            "message": {"type": "string", "minLength": 1},
            "type": {"type": "string", "enum": ["invalid_request_error", "authentication_error", "permission_error",
                                                "rate_limit_error", "server_error"]},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]},
        },
    }},
}

# ---- request bodies ------------------------------------------------------------------------

# The sampling fields /v1/completions and /v1/chat/completions share (SamplingParams validates them).
_SAMPLING = {
    "model": {"type": "string", "description": "the served model's id (GET /v1/models); another id is a 404"},
    "max_tokens": {"type": ["integer", "null"], "minimum": 1, "default": 16,
                   "description": "prompt tokens plus max_tokens must fit the model's context"},
    "temperature": {"type": ["number", "null"], "minimum": 0, "default": 1, "description": "0 = greedy"},
    "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1, "default": 1},
    "top_k": {"type": ["integer", "null"], "minimum": -1, "default": 0,
              "description": "llmq extension (as vLLM); 0 or -1 = off"},
    "n": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_N, "default": 1,
          "description": "samples per prompt; at most the server's LLMQ_MAX_NUM_SEQS"},
    "stop": {"anyOf": [_NON_EMPTY_STRING, {"type": "array", "maxItems": MAX_STOP_SEQUENCES, "items": _NON_EMPTY_STRING},
                       {"type": "null"}],
             "description": "up to 4 stop strings; the stop string itself is not in the text"},
    "seed": {"type": ["integer", "null"], "description": "per-request seed; the same seed gives the same text"},
    "stream": {"type": ["boolean", "null"], "default": False,
               "description": "answer as text/event-stream chunks, ending with `data: [DONE]`"},
    "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": ["boolean", "null"]}}},
    "user": {"type": ["string", "null"], "description": "stored with the request, not interpreted"},
    "ignore_eos": {"type": ["boolean", "null"], "default": False, "description": "llmq extension (as vLLM)"},
    "stop_token_ids": {"type": ["array", "null"], "items": _TOKEN_ID, "description": "llmq extension (as vLLM)"},
    # OpenAI fields llmq does not implement: accepted only at their neutral value.
    "presence_penalty": {"enum": [0, None], "description": "not supported: only 0 or null"},
    "frequency_penalty": {"enum": [0, None], "description": "not supported: only 0 or null"},
    "logit_bias": {"anyOf": [{"type": "object", "maxProperties": 0}, {"type": "null"}],
                   "description": "not supported: only {} or null"},
}

_TOKEN_IDS = {"type": "array", "minItems": 1, "items": _TOKEN_ID}

COMPLETION_REQUEST = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        **_SAMPLING,
        "prompt": {"anyOf": [_NON_EMPTY_STRING, _TOKEN_IDS,
                             {"type": "array", "minItems": 1, "items": {"anyOf": [_NON_EMPTY_STRING, _TOKEN_IDS]}}],
                   "description": "a string, a list of strings, a list of token ids, or a list of token-id lists"},
        "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS,
                     "description": "log-probabilities of the chosen token plus this many alternatives"},
        "echo": {"type": ["boolean", "null"], "default": False},
        "best_of": {"type": ["integer", "null"], "minimum": 1, "description": "only equal to n"},
        "suffix": {"enum": ["", None], "description": "not supported: only empty or null"},
    },
}

_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}

CHAT_COMPLETION_REQUEST = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        **_SAMPLING,
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role"],
            "properties": {"role": {"type": "string"},
                           "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}},
        }, "description": "rendered with the model's chat template (a model without one answers 400)"},
        "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1,
                                  "description": "the same as max_tokens; wins when both are given"},
        "logprobs": {"type": ["boolean", "null"], "default": False},
        "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS},
    },
}

BATCH_CREATE = {
    "type": "object",
    "required": ["input_file_id", "endpoint", "completion_window"],
    "properties": {
        "input_file_id": {**_NON_EMPTY_STRING, "description": "a file uploaded with purpose 'batch'"},
        "endpoint": {"enum": ["/v1/completions", "/v1/chat/completions"]},
        "completion_window": {"type": "string", "pattern": "^[1-9][0-9]{0,5}[smh]$",
                              "description": "'24h' (as OpenAI), or any whole number of seconds, minutes or hours "
                                             "('90s', '30m', '72h') up to 168h; a batch still running when it "
                                             "ends is expired"},
        "metadata": {"type": ["object", "null"], "maxProperties": 16, "propertyNames": {"maxLength": 64},
                     "additionalProperties": {"type": "string", "maxLength": 512}},
    },
}

FILE_UPLOAD = {
    "type": "object",
    "required": ["file", "purpose"],
    "properties": {
        # No type: a multipart part is bytes, whatever they hold.
        "file": {"contentMediaType": "application/octet-stream",
                 "description": "JSON Lines, one batch request per line (checked when a batch is created)"},
        "purpose": {"const": "batch"},
    },
}

# ---- answers -------------------------------------------------------------------------------

USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
         "properties": {name: {"type": "integer", "minimum": 0}
                        for name in ("prompt_tokens", "completion_tokens", "total_tokens")}}

_FINISH_REASON = {"type": ["string", "null"], "enum": ["stop", "length", None]}

COMPLETION = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices"],
    "properties": {
        "id": {"type": "string"}, "object": {"const": "text_completion"}, "created": _UNIX_SECONDS,
        "model": {"type": "string"}, "usage": ref("Usage"),
        "choices": {"type": "array", "items": {
            "type": "object", "required": ["index", "text", "logprobs", "finish_reason"],
            "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                           "logprobs": {"type": ["object", "null"]}, "finish_reason": _FINISH_REASON}}},
    },
}

CHAT_COMPLETION = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices"],
    "properties": {
        "id": {"type": "string"}, "object": {"const": "chat.completion"}, "created": _UNIX_SECONDS,
        "model": {"type": "string"}, "usage": ref("Usage"),
        "choices": {"type": "array", "items": {
            "type": "object", "required": ["index", "message", "logprobs", "finish_reason"],
            "properties": {"index": {"type": "integer"}, "finish_reason": _FINISH_REASON,
                           "logprobs": {"type": ["object", "null"]},
                           "message": {"type": "object", "required": ["role", "content"],
                                       "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}}}}},
    },
}

REQUEST = {
    "type": "object",
    "description": "One completion as now known: its status, timings, the text so far, the answer once completed.",
    "required": ["id", "object", "status", "model", "endpoint", "created_at", "started_at", "first_token_at",
                 "finished_at", "text", "choices", "usage", "response", "error"],
    "properties": {
        "id": {"type": "string"}, "object": {"const": "request"},
        "status": {"enum": ["queued", "running", "completed", "failed", "cancelled"]},
        "model": {"type": "string"}, "endpoint": {"enum": ["/v1/completions", "/v1/chat/completions"]},
        "created_at": {"type": "number"}, "started_at": _UNIX_TIME_OR_NULL,
        "first_token_at": _UNIX_TIME_OR_NULL, "finished_at": _UNIX_TIME_OR_NULL,
        "text": {"type": "string", "description": "the first choice's text so far"},
        "choices": {"type": "array", "items": {
            "type": "object", "required": ["index", "text", "finish_reason"],
            "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                           "finish_reason": {"type": ["string", "null"],
                                             "description": "the engine's own: stop, length, or abort (cancelled)"}}}},
        "usage": nullable(ref("Usage")),
        "response": {"anyOf": [ref("Completion"), ref("ChatCompletion"), {"type": "null"}],
                     "description": "the whole answer, once completed"},
        "error": {"type": ["object", "null"], "properties": {"code": {"type": ["string", "null"]},
                                                              "message": {"type": "string"}}},
    },
}

# Server-Sent Events: each schema is one event as its fields arrive (data, event, id), as OpenAPI
# 3.2's itemSchema puts it; heartbeat comments (": keep-alive") carry no event.
COMPLETION_STREAM_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string", "description": (
        "one chunk's JSON (the completion shape, text deltas in its choices), a usage chunk with empty choices, "
        "or an error object; the last event's data is [DONE]")}},
}

REQUEST_STREAM_EVENT = {
    "type": "object",
    "required": ["id", "event", "data"],
    "properties": {
        "id": {"type": "string", "pattern": r"^\d+-\d+$", "description": "the Redis stream entry id (Last-Event-ID)"},
        "event": {"enum": ["delta", "done", "error"]},
        "data": {"type": "string", "contentMediaType": "application/json", "description": (
            "delta: {type, index, text, token_ids, logprobs, finish_reason, t}; done: {type, usage, t}; "
            "error: {type, error: {code, message, param}, t}")},
    },
}

MODEL = {"type": "object", "required": ["id", "object", "created", "owned_by"],
         "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                        "owned_by": {"type": "string"}}}

FILE = {
    "type": "object",
    "required": ["id", "object", "bytes", "created_at", "filename", "purpose", "status", "expires_at"],
    "properties": {
        "id": {"type": "string"}, "object": {"const": "file"}, "bytes": {"type": "integer", "minimum": 0},
        "created_at": _UNIX_SECONDS, "filename": {"type": "string"},
        "purpose": {"enum": ["batch", "batch_output"]}, "status": {"const": "processed"},
        "expires_at": {"type": "null"},
    },
}

FILE_DELETED = {"type": "object", "required": ["id", "object", "deleted"],
                "properties": {"id": {"type": "string"}, "object": {"const": "file"}, "deleted": {"const": True}}}

BATCH = {
    "type": "object",
    "required": ["id", "object", "endpoint", "errors", "input_file_id", "completion_window", "status",
                 "output_file_id", "error_file_id", "created_at", "in_progress_at", "expires_at", "finalizing_at",
                 "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at", "request_counts",
                 "metadata"],
    "properties": {
        "id": {"type": "string"}, "object": {"const": "batch"},
        "endpoint": {"enum": ["/v1/completions", "/v1/chat/completions"]},
        "errors": {"type": ["object", "null"], "description": "why the whole input was unusable (status failed)",
                   "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
                       "type": "object", "properties": {"code": {"type": ["string", "null"]},
                                                        "message": {"type": "string"},
                                                        "param": {"type": ["string", "null"]},
                                                        "line": {"type": ["integer", "null"]}}}}}},
        "input_file_id": {"type": "string"}, "completion_window": {"type": "string"},
        "status": {"enum": ["validating", "failed", "in_progress", "finalizing", "completed", "expired",
                            "cancelling", "cancelled"]},
        "output_file_id": {"type": ["string", "null"]}, "error_file_id": {"type": ["string", "null"]},
        "created_at": _UNIX_SECONDS, "expires_at": _UNIX_SECONDS_OR_NULL,
        **{name: _UNIX_SECONDS_OR_NULL for name in ("in_progress_at", "finalizing_at", "completed_at", "failed_at",
                                                    "expired_at", "cancelling_at", "cancelled_at")},
        "request_counts": {"type": "object", "required": ["total", "completed", "failed"],
                           "properties": {name: {"type": "integer", "minimum": 0}
                                          for name in ("total", "completed", "failed")}},
        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}

WORKER = {
    "type": "object",
    "description": "A worker's latest heartbeat (workers that missed three are left out).",
    "required": ["name", "model", "at"],
    "properties": {"name": {"type": "string"}, "model": {"type": "string"}, "at": {"type": "number"},
                   **{name: {"type": "integer", "minimum": 0}
                      for name in ("running", "waiting", "free_blocks", "total_blocks", "steps", "tokens")},
                   "busy_seconds": {"type": "number", "minimum": 0,
                                    "description": "Seconds the engine spent in its steps since the worker started."}},
}


def list_of(item: dict, **extra: dict) -> dict:
    return {"type": "object", "required": ["object", "data", *extra],
            "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": item}, **extra}}


SCHEMAS = {
    "Error": ERROR,
    "CompletionRequest": COMPLETION_REQUEST,
    "ChatCompletionRequest": CHAT_COMPLETION_REQUEST,
    "BatchCreateRequest": BATCH_CREATE,
    "FileUpload": FILE_UPLOAD,
    "Usage": USAGE,
    "Completion": COMPLETION,
    "ChatCompletion": CHAT_COMPLETION,
    "Request": REQUEST,
    "CompletionStreamEvent": COMPLETION_STREAM_EVENT,
    "RequestStreamEvent": REQUEST_STREAM_EVENT,
    "Model": MODEL,
    "ModelList": list_of(ref("Model")),
    "File": FILE,
    "FileList": list_of(ref("File"), has_more={"type": "boolean"}),
    "FileDeleted": FILE_DELETED,
    "Batch": BATCH,
    "BatchList": list_of(ref("Batch"), first_id={"type": ["string", "null"]}, last_id={"type": ["string", "null"]},
                         has_more={"type": "boolean"}),
    "WorkerList": list_of(ref("Worker")),
    "Worker": WORKER,
}
