"""The OpenAI completions and batch shapes: request bodies in, response objects out. No torch.

Shared by the offline batch runner and the web API, so a body accepted by one is accepted by the other.
"""
from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import Any

from llmq.errors import InvalidRequest
from llmq.limits import MAX_LOGPROBS, MAX_STOP_SEQUENCES
from llmq.outputs import TokenLogprob
from llmq.sampling_params import SamplingParams

COMPLETIONS_ENDPOINT = "/v1/completions"
# Fields OpenAI defines that llmq does not implement: accepted only null or at their neutral value.
_UNSUPPORTED = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "suffix": ""}


@dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]
    params: SamplingParams
    echo: bool = False
    stream: bool = False
    include_usage: bool = False
    user: str | None = None


def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a /v1/completions body. Raises InvalidRequest naming the field."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", None)
    if "prompt" not in body:
        raise InvalidRequest("you must provide a prompt", "prompt")
    _refuse_unsupported(body)
    n = body.get("n", 1)
    if body.get("best_of") not in (None, n):
        raise InvalidRequest("best_of is supported only equal to n", "best_of")
    logprobs = body.get("logprobs")
    if isinstance(logprobs, bool):
        raise InvalidRequest("logprobs must be an integer (how many alternatives) or null", "logprobs")
    params = _sampling_params(body, _default(body, "max_tokens", 16), logprobs)
    model, stream, include_usage = _envelope(body)
    return CompletionRequest(model=model, prompts=_prompts(body["prompt"]), params=params, echo=_flag(body, "echo"),
                             stream=stream, include_usage=include_usage, user=body.get("user"))


def _refuse_unsupported(body: dict) -> None:
    for field, neutral in _UNSUPPORTED.items():
        value = body.get(field)
        # Each field's own neutral value only (suffix {} or presence_penalty "" say something else);
        # bool is excluded because False == 0 in Python.
        if value is not None and (isinstance(value, bool) or value != neutral):
            raise InvalidRequest(f"{field} is not supported by llmq (send {json.dumps(neutral)} or null)", field)


def _sampling_params(body: dict, max_tokens, logprobs) -> SamplingParams:
    """The sampling fields both endpoints share (validated by SamplingParams itself)."""
    params = SamplingParams(
        n=_default(body, "n", 1), temperature=_default(body, "temperature", 1.0), top_p=_default(body, "top_p", 1.0),
        top_k=_default(body, "top_k", 0), seed=body.get("seed"), max_tokens=max_tokens, stop=body.get("stop"),
        stop_token_ids=_default(body, "stop_token_ids", ()), ignore_eos=_default(body, "ignore_eos", False),
        logprobs=logprobs)
    if len(params.stop) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(f"stop takes at most {MAX_STOP_SEQUENCES} sequences", "stop")
    for stop in params.stop:
        check_text(stop, "stop")
    return params


def _envelope(body: dict) -> tuple[str | None, bool, bool]:
    """(model, stream, stream_options.include_usage), checked. user is checked too, and kept as given."""
    stream_options = {} if body.get("stream_options") is None else body["stream_options"]
    if not isinstance(stream_options, dict):
        raise InvalidRequest("stream_options must be an object", "stream_options")
    include_usage = stream_options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise InvalidRequest("stream_options.include_usage must be a boolean", "stream_options.include_usage")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("model must be a string", "model")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise InvalidRequest("user must be a string", "user")
    return model, _flag(body, "stream"), bool(include_usage)


def _default(body: dict, field: str, default):
    value = body.get(field)
    return default if value is None else value


def _flag(body: dict, field: str) -> bool:
    value = body.get(field, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest(f"{field} must be a boolean", field)
    return value


def _is_token_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts(prompt) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif _is_token_list(prompt) and prompt:
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_list(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise InvalidRequest("prompt must be a string, a list of strings, a list of token ids, or a list of "
                             "token-id lists, and not empty", "prompt")
    if any(len(p) == 0 for p in prompts):
        raise InvalidRequest("prompt must not be empty", "prompt")
    for p in prompts:
        if isinstance(p, str):
            check_text(p, "prompt")
    return prompts


# ---- responses -----------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def completion_logprobs(logprobs: list[TokenLogprob], token_text, start_offset: int = 0) -> dict:
    """OpenAI's legacy completions logprobs object. `token_text(id)` gives a token's text."""
    tokens, offsets, offset = [], [], start_offset
    for lp in logprobs:
        text = token_text(lp.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{token_text(t): v for t, v in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


# ---- JSON in -----------------------------------------------------------------------------------

class BadJSON(ValueError):
    """JSON that llmq refuses though Python's parser would take it, or that the parser chokes on."""


def _refuse_constant(name: str):
    raise BadJSON(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e309
        raise BadJSON(f"{text[:20]} is too large a number")
    return value


def loads(text: str | bytes):
    """json.loads, strict where a client's document must be: no NaN or Infinity (Python's parser takes
    them, JSON does not), no number beyond a float's range, and nesting too deep for the parser (its
    RecursionError) refused as BadJSON, as any other malformed document is."""
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise BadJSON("it is nested too deeply") from None
    except json.JSONDecodeError as err:
        raise BadJSON(err.msg) from None


def jsonl_lines(text: str) -> list[tuple[int, str]]:
    """The non-blank lines of a JSONL file, numbered from 1. Lines end at "\n" (or "\r\n") and nowhere
    else: str.splitlines() also splits on U+2028, U+2029, U+0085 and others that a JSON string may
    hold unescaped."""
    return [(n, line.removesuffix("\r")) for n, line in enumerate(text.split("\n"), start=1) if line.strip()]


def check_text(value: str, param: str) -> str:
    """A string that can be encoded: one holding a lone surrogate ("\ud800" parses) cannot be
    tokenized, nor written back in an answer."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{param} holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which is not "
                             "text", param) from None
    return value


# ---- batch files ---------------------------------------------------------------------------

class BatchLineError(ValueError):
    """One unusable input line; becomes one error line."""

    def __init__(self, message: str, code: str, line: int, custom_id: str | None = None):
        super().__init__(message)
        self.code, self.line, self.custom_id = code, line, custom_id


@dataclass(frozen=True)
class BatchLine:
    line: int  # 1-based line number in the input file
    custom_id: str
    body: dict


def parse_batch_line(text: str, line: int, endpoint: str = COMPLETIONS_ENDPOINT) -> BatchLine:
    """One JSONL request line: {"custom_id", "method": "POST", "url": endpoint, "body": {...}}."""
    try:
        obj = loads(text)
    except BadJSON as err:
        raise BatchLineError(f"line {line} is not valid JSON: {err}", "invalid_json", line) from None
    if not isinstance(obj, dict):
        raise BatchLineError(f"line {line} must be a JSON object", "invalid_request", line)
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BatchLineError(f"line {line} needs a non-empty string custom_id", "missing_custom_id", line)
    if obj.get("method") != "POST":
        raise BatchLineError(f"line {line}: method must be POST", "invalid_method", line, custom_id)
    if obj.get("url") != endpoint:
        raise BatchLineError(f"line {line}: url must be {endpoint}, the batch's endpoint, got {obj.get('url')!r}",
                             "invalid_url", line, custom_id)
    if not isinstance(obj.get("body"), dict):
        raise BatchLineError(f"line {line}: body must be a JSON object", "invalid_body", line, custom_id)
    return BatchLine(line, custom_id, obj["body"])


def line_error_message(err: InvalidRequest, line: int) -> str:
    """A request line's InvalidRequest as its error line says it."""
    return f"line {line}: {err}" + (f" (param: {err.param})" if err.param else "")


def batch_output_line(custom_id: str, body: dict, status_code: int = 200) -> dict:
    return {"id": new_id("batch_req_"), "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": body.get("id", new_id("req_")), "body": body},
            "error": None}


def batch_error_line(custom_id: str | None, code: str, message: str, line: int | None = None) -> dict:
    error = {"code": code, "message": message}
    if line is not None:
        error["line"] = line
    return {"id": new_id("batch_req_"), "custom_id": custom_id, "response": None, "error": error}


# ---- chat completions ----------------------------------------------------------------------

CHAT_ENDPOINT = "/v1/chat/completions"


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: list[dict]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    user: str | None = None


def _message_text(content, index: int) -> str:
    if isinstance(content, str):
        return check_text(content, f"messages[{index}].content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):
        return check_text("".join(p["text"] for p in content), f"messages[{index}].content")
    raise InvalidRequest(f"messages[{index}].content must be a string or a list of text parts "
                         '({"type": "text", "text": "..."})', f"messages[{index}].content")


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a /v1/chat/completions body. Raises InvalidRequest naming the field."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", None)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", "messages")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a role", f"messages[{i}]")
        check_text(message["role"], f"messages[{i}].role")
        clean.append({"role": message["role"], "content": _message_text(message.get("content", ""), i)})
    _refuse_unsupported(body)
    top_logprobs = _default(body, "top_logprobs", 0)
    # Checked even when logprobs is off, so a wrong value is named rather than silently ignored.
    if not (isinstance(top_logprobs, int) and not isinstance(top_logprobs, bool) and 0 <= top_logprobs <= MAX_LOGPROBS):
        raise InvalidRequest(f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {top_logprobs!r}",
                             "top_logprobs")
    for field in ("max_tokens", "max_completion_tokens"):  # both checked: the one not used must not be wrong
        value = body.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InvalidRequest(f"{field} must be an integer >= 1, got {value!r}", field)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    params = _sampling_params(body, 16 if max_tokens is None else max_tokens,
                              top_logprobs if _flag(body, "logprobs") else None)
    model, stream, include_usage = _envelope(body)
    return ChatRequest(model, clean, params, stream, include_usage, body.get("user"))


def chat_logprobs(logprobs: list[TokenLogprob], token_text) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs]}


def response_finish_reason(reason: str | None) -> str | None:
    """Engine finish reasons in OpenAI's words ("abort" never reaches a client as such)."""
    return {"abort": "stop"}.get(reason, reason)
