"""What crosses between a worker's task threads and its engine (and the engine process's pipe):
the request as the engine runs it, the result, the errors a run ends with, and the pipe's messages.

Every type here pickles as it is, errors included, so the engine process hands back the same
InvalidRequest, EngineFailure or HandedBack that an in-process engine raises.
"""
from __future__ import annotations

from dataclasses import dataclass

from llmq.errors import InvalidRequest
from llmq.events import StreamProgress
from llmq.outputs import CompletionOutput
from llmq.sampling_params import SamplingParams


class EngineFailure(RuntimeError):
    """The engine broke while running a request (a bug or a device fault), not the request's fault."""


class StreamWriteFailure(EngineFailure):
    """The request's events could not be written to Redis (away past the client's retry window). Its
    stream holds what was written before: once Redis answers again, the request can go on from there."""


class HandedBack(RuntimeError):
    """This worker is stopping (or another has taken the request over): the request goes back to the
    queue, to be resumed from its checkpoint."""


EngineError = InvalidRequest | EngineFailure | StreamWriteFailure | HandedBack


@dataclass(frozen=True)
class EngineRequest:
    """One API request (or batch line) as the engine runs it: each prompt's token ids, sampled n
    times. Immutable: it crosses the engine process's pipe as it is."""

    request_id: str
    prompts: tuple[tuple[int, ...], ...]
    params: SamplingParams
    resume_from: StreamProgress | None = None  # what an earlier run of this request already streamed
    priority: int = 0  # the scheduler's, within the tenant's work: lower is admitted first
    tenant: str = ""  # whose request: the scheduler shares slots and tokens fairly between tenants
    weight: float = 1.0  # the tenant's weight in that share (LLMQ_TENANT_WEIGHTS)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompts", tuple(tuple(ids) for ids in self.prompts))


@dataclass(frozen=True)
class EngineResult:
    """A finished request: each prompt's n outputs, and when its first token came."""

    outputs: tuple[tuple[CompletionOutput, ...], ...]  # [prompt][sample]
    prompt_token_ids: tuple[tuple[int, ...], ...]
    first_token_at: float | None = None

    @property
    def cancelled(self) -> bool:
        return any(o.finish_reason == "abort" for outs in self.outputs for o in outs)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(len(o.token_ids) for outs in self.outputs for o in outs)


# ---- the engine process's pipe: worker -> engine -----------------------------------------------

@dataclass(frozen=True)
class Run:
    number: int  # the worker's own count, to match the answer with its waiting task
    request: EngineRequest


@dataclass(frozen=True)
class Cancel:
    request_id: str


@dataclass(frozen=True)
class HandBack:
    request_id: str | None  # None: every request in flight


@dataclass(frozen=True)
class AskStats:
    pass


@dataclass(frozen=True)
class Stop:
    pass


# ---- engine -> worker ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Ready:
    stats: dict


@dataclass(frozen=True)
class LoadFailed:
    reason: str


@dataclass(frozen=True)
class Finished:
    number: int
    result: EngineResult | None  # None when it ended with `error`
    error: EngineError | None = None


@dataclass(frozen=True)
class Stats:
    stats: dict
