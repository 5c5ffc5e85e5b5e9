"""Stream events -> OpenAI objects: the completion answer, streaming chunks, errors. No I/O.

The events are those of app/streams.py; a delta's `index` is the choice index (prompt number * n +
sample number). The waiting and streaming endpoints and the requests resource all build their
answers here, so a client sees the same text, finish reasons and logprobs whichever way it asks.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import orjson

from workers.engine.outputs import TokenLogprob
from workers.openai_protocol import chat_logprobs, completion_logprobs, response_finish_reason

TokenText = Callable[[int], str]

HEARTBEAT = ": keep-alive\n\n"  # an SSE comment: clients ignore it, a gone client makes the write fail
DONE = "data: [DONE]\n\n"


def sse_data(obj: dict) -> str:
    return f"data: {orjson.dumps(obj).decode()}\n\n"


def sse_event(entry_id: str | None, event: dict) -> str:
    """A raw stream event as SSE, with the stream entry id so a client can resume (Last-Event-ID)."""
    head = f"id: {entry_id}\n" if entry_id else ""
    return f"{head}event: {event['type']}\ndata: {orjson.dumps(event).decode()}\n\n"


def event_logprobs(raw: list[dict] | None) -> list[TokenLogprob] | None:
    """A delta event's logprobs ([{"token_id", "logprob", "top": [[id, lp], ...]}]) as TokenLogprobs."""
    if raw is None:
        return None
    return [TokenLogprob(lp["token_id"], lp["logprob"], tuple((int(t), float(v)) for t, v in lp.get("top", ())))
            for lp in raw]


@dataclass(frozen=True)
class ResponseSpec:
    """What assembling an answer needs to know about the request, fixed when it is submitted."""

    id: str
    kind: str  # "completion" | "chat"
    model: str
    created: int
    num_choices: int  # prompts * n
    n: int = 1
    logprobs: bool = False  # the client asked for logprobs
    echo_prefixes: tuple[str, ...] = ()  # per prompt: the decoded prompt, when a completion asks for echo
    include_usage: bool = False

    def prefix(self, index: int) -> str:
        return self.echo_prefixes[index // self.n] if self.echo_prefixes else ""


@dataclass
class ChoiceState:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class StreamState:
    """What the events so far say: each choice's text, and the usage or error once the request ended."""

    choices: dict[int, ChoiceState] = field(default_factory=dict)
    usage: dict | None = None
    error: dict | None = None

    @property
    def ended(self) -> bool:
        return self.usage is not None or self.error is not None

    def choice(self, index: int) -> ChoiceState:
        return self.choices.setdefault(index, ChoiceState(index))

    def add(self, event: dict) -> None:
        kind = event.get("type")
        if kind == "delta":
            choice = self.choice(event["index"])
            choice.text += event.get("text", "")
            choice.token_ids.extend(event.get("token_ids") or ())
            choice.logprobs.extend(event_logprobs(event.get("logprobs")) or ())
            if event.get("finish_reason") is not None:
                choice.finish_reason = event["finish_reason"]
        elif kind == "done":
            self.usage = event.get("usage")
        elif kind == "error":
            self.error = event.get("error") or {"code": "server_error", "message": "the request failed"}


def accumulate(events: Iterable[dict]) -> StreamState:
    state = StreamState()
    for event in events:
        state.add(event)
    return state


# ---- the whole answer ----------------------------------------------------------------------

def response_object(spec: ResponseSpec, state: StreamState, token_text: TokenText) -> dict:
    """The completion (or chat.completion) object of an ended request, choices in index order."""
    choices = []
    for index in range(max(spec.num_choices, len(state.choices))):
        choice = state.choices.get(index, ChoiceState(index))
        finish_reason = response_finish_reason(choice.finish_reason)
        if spec.kind == "chat":
            logprobs = chat_logprobs(choice.logprobs, token_text) if spec.logprobs else None
            choices.append({"index": index, "message": {"role": "assistant", "content": choice.text},
                            "logprobs": logprobs, "finish_reason": finish_reason})
        else:
            prefix = spec.prefix(index)
            logprobs = completion_logprobs(choice.logprobs, token_text, len(prefix)) if spec.logprobs else None
            choices.append({"index": index, "text": prefix + choice.text, "logprobs": logprobs,
                            "finish_reason": finish_reason})
    body = {"id": spec.id, "object": "chat.completion" if spec.kind == "chat" else "text_completion",
            "created": spec.created, "model": spec.model, "choices": choices}
    if state.usage is not None:
        body["usage"] = state.usage
    return body


_ERROR_STATUS = {"invalid_request": 400, "cancelled": 409}


def error_reply(error: dict) -> tuple[int, dict]:
    """An error event's error as (HTTP status, OpenAI error body). A request the engine refused is the
    client's to fix (400); one cancelled before it ran is a conflict (409); anything else is ours (500)."""
    code = error.get("code") or "server_error"
    status = _ERROR_STATUS.get(code, 500)
    body = {"error": {"message": error.get("message") or "the request failed",
                      "type": "invalid_request_error" if status < 500 else "server_error",
                      "param": error.get("param"), "code": code}}
    return status, body


# ---- streaming chunks ----------------------------------------------------------------------

class ChunkBuilder:
    """Turns delta events into OpenAI stream chunks. Keeps per choice whether the echo prefix went
    out and the text offset that the next chunk's logprobs start at."""

    def __init__(self, spec: ResponseSpec, token_text: TokenText):
        self.spec, self.token_text = spec, token_text
        self.object = "chat.completion.chunk" if spec.kind == "chat" else "text_completion"
        self._offsets: dict[int, int] = {}  # choice index -> characters sent so far

    def chunk(self, choices: list[dict], **extra) -> dict:
        return {"id": self.spec.id, "object": self.object, "created": self.spec.created,
                "model": self.spec.model, "choices": choices, **extra}

    def opening(self) -> list[dict]:
        """Chat streams open with the assistant's role for every choice, before any content."""
        if self.spec.kind != "chat":
            return []
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]) for i in range(self.spec.num_choices)]

    def chunks(self, event: dict) -> list[dict]:
        """The chunks one event becomes (none for done/error events or an empty delta)."""
        if event.get("type") != "delta":
            return []
        index, text = event["index"], event.get("text", "")
        finish_reason = response_finish_reason(event.get("finish_reason"))
        logprobs = (event_logprobs(event.get("logprobs")) or []) if self.spec.logprobs else None
        if self.spec.kind == "chat":
            return self._chat_chunks(index, text, logprobs, finish_reason)
        prefix = ""
        if index not in self._offsets:  # the echo goes out with a choice's first chunk
            prefix = self.spec.prefix(index)
            self._offsets[index] = len(prefix)
        if not (prefix or text or logprobs) and finish_reason is None:
            return []  # the detokenizer held back an incomplete character: nothing to say yet
        lp = completion_logprobs(logprobs, self.token_text, self._offsets[index]) if logprobs is not None else None
        self._offsets[index] += len(text)
        return [self.chunk([{"index": index, "text": prefix + text, "logprobs": lp, "finish_reason": finish_reason}])]

    def _chat_chunks(self, index: int, text: str, logprobs: list[TokenLogprob] | None,
                     finish_reason: str | None) -> list[dict]:
        out = []
        if text or logprobs:
            lp = chat_logprobs(logprobs, self.token_text) if logprobs is not None else None
            out.append(self.chunk([{"index": index, "delta": {"content": text}, "logprobs": lp,
                                    "finish_reason": None}]))
        if finish_reason is not None:  # OpenAI's last chunk of a choice: an empty delta and the reason
            out.append(self.chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}]))
        return out

    def usage_chunk(self, usage: dict) -> dict:
        return self.chunk([], usage=usage)

    def error_chunk(self, error: dict) -> dict:
        """How a failure mid-stream reaches the client (as vLLM does): an error object, then [DONE]."""
        return error_reply(error)[1]
