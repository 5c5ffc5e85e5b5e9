"""What the engine hands back: per-step deltas for streaming, whole outputs for offline use."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability under the model, and the `top` most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestDelta:
    """What one of a request's samples produced in one step. Joining `text` over a sample's deltas
    gives its final text; `finished` is set on its last delta."""

    request_id: str
    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, delta) -> None:
        """Join the next piece of this choice in: a RequestDelta from the engine, or the DeltaEvent it
        became in the request's stream (llmq.events). The one accumulator of a choice's text, tokens
        and logprobs."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = getattr(delta, "stop_reason", None)  # the stream does not carry it


@dataclass
class RequestOutput:
    """All samples of one request. `.text`, `.token_ids`, `.finish_reason`, `.logprobs` are the first
    sample's, for the common n == 1 case."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs
