"""The contract between workers (who write) and anyone who reads: the web process, or your own
plain Redis client. Redis key names, the stream events and their one codec, and the one
accumulator of a request's events.

Per request id:
  llmq:stream:{id}   a Redis Stream, one entry per event, field "data" = the event's JSON, entry id
                     "0-<n>" for the request's n-th event (so a retried write is never a second
                     entry); capped (MAXLEN ~, never below what its request can make) and
                     expiring a while after the request ends; replayable
  llmq:tokens:{id}   a pub/sub channel; every event is also PUBLISHed here as the same JSON
  llmq:cancel:{id}   set when the request is cancelled; a task that sees it never starts
  llmq:lease:{id}    the name of the worker running the request, expiring unless renewed: a
                     redelivered task runs the request only once this is free
Shared:
  llmq:cancel        pub/sub channel of cancelled request ids; workers abort them at the next step
  llmq:workers       hash: worker name -> heartbeat JSON (model, state: starting/ready/draining,
                     running, waiting, free/total KV blocks, max_num_seqs, capacity, tokens_per_s,
                     the loop's steps, busy_seconds and tokens since the worker started, at; see
                     llmq/fleet.py)
  llmq:sweep         a short lock: the worker holding it expires batches past their completion window
  llmq:held:{worker} hash: the work a worker has taken from the broker and not finished (task:arg ->
                     its task, argument, priority and queue), so the sweep sends a dead worker's
                     work again as soon as its heartbeats stop (llmq/fleet.py)
  llmq:autoscaler    hash: model -> the autoscaler's latest decision JSON (desired, actual, min, max,
                     backend, at), written every tick by `llmq autoscale`
  llmq:steps         a pub/sub channel: each write (a worker writes once per engine step) is also
                     published here whole, as one JSON array of [stream key, event number, event]
                     for every event it appended, so a web process gets a step's events in one push
  llmq:web-wake:{id} a pub/sub channel per web process: a new reader wakes the process's stream
                     reader (app/stream_hub.py)

Events (JSON objects, `type` first):
  {"type": "delta", "index": i, "text": "...", "token_ids": [...],
   "logprobs": [{"token_id", "logprob", "top": [[id, logprob], ...]}] | null,
   "finish_reason": null | "stop" | "length" | "abort", "t": unix time}
  {"type": "done", "usage": {"prompt_tokens", "completion_tokens", "total_tokens"}, "t": ...}
  {"type": "error", "error": {"code", "message", "param"}, "t": ...}
`index` is the choice index: prompt number * n + sample number.

The stream is also the request's checkpoint: a worker that takes over an interrupted request reads
it back (llmq.streams.read_progress) and goes on from the tokens it holds, appending to the same
stream, so a reader sees one unbroken sequence of events, nothing twice.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from llmq.outputs import CompletionOutput, TokenLogprob

CANCEL_CHANNEL = "llmq:cancel"
STEPS_CHANNEL = "llmq:steps"
WORKERS_KEY = "llmq:workers"
SWEEP_LOCK_KEY = "llmq:sweep"  # held by the worker sweeping for expired batches
AUTOSCALER_KEY = "llmq:autoscaler"


def stream_key(request_id: str) -> str:
    return f"llmq:stream:{request_id}"


def tokens_channel(request_id: str) -> str:
    return f"llmq:tokens:{request_id}"


def cancel_key(request_id: str) -> str:
    return f"llmq:cancel:{request_id}"


def lease_key(request_id: str) -> str:
    return f"llmq:lease:{request_id}"


def held_key(worker: str) -> str:
    """The work a worker holds (taken from the broker, not finished): see llmq/fleet.py."""
    return f"llmq:held:{worker}"


def parked_tenants_key(model: str) -> str:
    """The set of tenants with work parked for the model (workers/tenant_intake.py)."""
    return f"llmq:parked:{model}"


def parked_key(model: str, tenant: str) -> str:
    """A tenant's parked work for the model: a sorted set, broker priority first, then oldest first."""
    return f"llmq:parked:{model}:{tenant}"


def history_key(model: str) -> str:
    """The model's fleet over the last hour, a sample per time bucket (llmq/fleet_history.py)."""
    return f"llmq:history:{model}"


def parked_count_key(model: str, tenant: str) -> str:
    """How many works the tenant has ever parked for the model: numbers them, for their order."""
    return f"llmq:parked-count:{model}:{tenant}"


# ---- the events ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class DeltaEvent:
    """What one choice produced in one engine step."""

    index: int  # the choice: prompt number * n + sample number
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None  # set on the choice's last delta: "stop", "length" or "abort"
    t: float = 0.0  # unix time the step returned
    type = "delta"


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens}


@dataclass(frozen=True, slots=True)
class DoneEvent:
    """The request finished: every choice has its finish_reason."""

    usage: Usage
    t: float = 0.0
    type = "done"


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    """The request ended without finishing: `code` is "invalid_request", "cancelled" or "server_error"."""

    code: str
    message: str
    param: str | None = None
    t: float = 0.0
    type = "error"

    def as_dict(self) -> dict:
        return {"code": self.code, "message": self.message, "param": self.param}


Event = DeltaEvent | DoneEvent | ErrorEvent
EndEvent = DoneEvent | ErrorEvent


# ---- the codec: every reader and writer of the events uses these --------------------------------

def to_dict(event: Event) -> dict[str, Any]:
    """The event as its JSON object."""
    if isinstance(event, DeltaEvent):
        logprobs = None
        if event.logprobs is not None:
            logprobs = [{"token_id": lp.token_id, "logprob": lp.logprob, "top": [list(pair) for pair in lp.top]}
                        for lp in event.logprobs]
        return {"type": "delta", "index": event.index, "text": event.text, "token_ids": list(event.token_ids),
                "logprobs": logprobs, "finish_reason": event.finish_reason, "t": event.t}
    if isinstance(event, DoneEvent):
        return {"type": "done", "usage": event.usage.as_dict(), "t": event.t}
    return {"type": "error", "error": event.as_dict(), "t": event.t}


def from_dict(obj: dict[str, Any]) -> Event:
    """An event from its JSON object. Raises ValueError for one that is not an llmq event."""
    kind = obj.get("type")
    if kind == "delta":
        raw = obj.get("logprobs")
        logprobs = None if raw is None else tuple(
            TokenLogprob(lp["token_id"], lp["logprob"], tuple((int(t), float(v)) for t, v in lp.get("top", ())))
            for lp in raw)
        return DeltaEvent(obj["index"], obj.get("text", ""), tuple(obj.get("token_ids") or ()), logprobs,
                          obj.get("finish_reason"), obj.get("t", 0.0))
    if kind == "done":
        usage = obj.get("usage") or {}
        return DoneEvent(Usage(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)), obj.get("t", 0.0))
    if kind == "error":
        error = obj.get("error") or {}
        return ErrorEvent(error.get("code") or "server_error", error.get("message") or "the request failed",
                          error.get("param"), obj.get("t", 0.0))
    raise ValueError(f"not an llmq stream event: type {kind!r}")


def encode(event: Event) -> bytes:
    return orjson.dumps(to_dict(event))


def decode(data: bytes | str) -> Event:
    return from_dict(orjson.loads(data))


# ---- the accumulator ----------------------------------------------------------------------------

@dataclass
class StreamProgress:
    """What a request's events say so far: each choice's text, tokens and logprobs (joined in one
    CompletionOutput per choice), and how the request ended, if it did. The web builds its answers
    from this, and a worker that resumes an interrupted request goes on from it."""

    choices: dict[int, CompletionOutput] = field(default_factory=dict)
    ended_with: EndEvent | None = None
    num_events: int = 0  # the number of the last event added: the next one written is num_events + 1

    def add(self, event: Event, number: int | None = None) -> None:
        """Join one event in; `number` is its number in the request's stream, when known."""
        self.num_events = self.num_events + 1 if number is None else number
        if isinstance(event, DeltaEvent):
            self.choice(event.index).add(event)
        else:
            self.ended_with = event

    def choice(self, index: int) -> CompletionOutput:
        output = self.choices.get(index)
        if output is None:
            output = self.choices[index] = CompletionOutput(index)
        return output

    @property
    def usage(self) -> Usage | None:
        return self.ended_with.usage if isinstance(self.ended_with, DoneEvent) else None

    @property
    def error(self) -> ErrorEvent | None:
        return self.ended_with if isinstance(self.ended_with, ErrorEvent) else None

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices.values())


def accumulate(events) -> StreamProgress:
    progress = StreamProgress()
    for event in events:
        progress.add(event)
    return progress
