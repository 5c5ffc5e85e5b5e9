"""A request's events -> OpenAI objects: the completion answer, streaming chunks, errors. No I/O.

The events are llmq/events.py's, joined by its StreamProgress; a delta's `index` is the choice index
(prompt number * n + sample number). The waiting and streaming endpoints, the requests resource and
the worker that stores a finished request's response all build their answers here, so a client
sees the same text, finish reasons and logprobs whichever way it asks.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llmq.events import DeltaEvent, ErrorEvent, Event, StreamProgress, Usage
from llmq.outputs import CompletionOutput, TokenLogprob
from llmq.protocol.openai import chat_logprobs, completion_logprobs, response_finish_reason

TokenText = Callable[[int], str]


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


# ---- the whole answer ----------------------------------------------------------------------

def response_object(spec: ResponseSpec, progress: StreamProgress, token_text: TokenText) -> dict:
    """The completion (or chat.completion) object of an ended request, choices in index order."""
    choices = []
    for index in range(max(spec.num_choices, len(progress.choices))):
        choice = progress.choices.get(index) or CompletionOutput(index)
        finish_reason = response_finish_reason(choice.finish_reason)
        logprobs = choice.logprobs or []
        if spec.kind == "chat":
            choices.append({"index": index, "message": {"role": "assistant", "content": choice.text},
                            "logprobs": chat_logprobs(logprobs, token_text) if spec.logprobs else None,
                            "finish_reason": finish_reason})
        else:
            prefix = spec.prefix(index)
            choices.append({"index": index, "text": prefix + choice.text,
                            "logprobs": completion_logprobs(logprobs, token_text, len(prefix)) if spec.logprobs else None,
                            "finish_reason": finish_reason})
    body = {"id": spec.id, "object": "chat.completion" if spec.kind == "chat" else "text_completion",
            "created": spec.created, "model": spec.model, "choices": choices}
    if progress.usage is not None:
        body["usage"] = progress.usage.as_dict()
    return body


_ERROR_STATUS = {"invalid_request": 400, "no_chat_template": 400, "cancelled": 409}


def error_reply(error: ErrorEvent) -> tuple[int, dict]:
    """An error event as (HTTP status, OpenAI error body). A request the engine refused is the
    client's to fix (400); one cancelled before it ran is a conflict (409); anything else is ours (500)."""
    status = _ERROR_STATUS.get(error.code, 500)
    body = {"error": {"message": error.message, "type": "invalid_request_error" if status < 500 else "server_error",
                      "param": error.param, "code": error.code}}
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

    def chunks(self, event: Event) -> list[dict]:
        """The chunks one event becomes (none for done/error events or an empty delta)."""
        if not isinstance(event, DeltaEvent):
            return []
        index, text = event.index, event.text
        finish_reason = response_finish_reason(event.finish_reason)
        logprobs = list(event.logprobs or ()) if self.spec.logprobs else None
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

    def usage_chunk(self, usage: Usage) -> dict:
        return self.chunk([], usage=usage.as_dict())

    def error_chunk(self, error: ErrorEvent) -> dict:
        """How a failure mid-stream reaches the client (as vLLM does): an error object, then [DONE]."""
        return error_reply(error)[1]
