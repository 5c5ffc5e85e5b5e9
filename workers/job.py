"""Job: one API request (or batch line) in the engine service, and what it takes to resume one.

A job is an API request's prompts (each with n samples) as the engine runs them. A job that resumes
an interrupted run starts from what the request's stream holds: each choice's text, tokens and
logprobs so far (`output_so_far`), and each unfinished sample runs as an engine request of its own
(`one_sample`), since samples of one prompt no longer share their position.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from app.streams import ChoiceProgress, StreamProgress
from workers.engine.config import SamplingParams
from workers.engine.outputs import CompletionOutput, TokenLogprob


class EngineFailure(RuntimeError):
    """The engine broke while running a request (a bug or a device fault), not the request's fault."""


@dataclass(eq=False)  # identity: jobs key the per-step event map
class Job:
    """One API request (possibly several prompts, each with n samples) in the engine."""

    request_id: str
    prompts: list
    params: SamplingParams
    resume_from: StreamProgress | None = None  # what an earlier run of this request already streamed
    priority: int = 0  # the scheduler's: lower is admitted first
    outputs: list[list[CompletionOutput]] = field(default_factory=list)  # [prompt][sample]
    prompt_token_ids: list[list[int]] = field(default_factory=list)
    # Engine request id -> (prompt number, its first sample): "#k" runs prompt k's n samples together;
    # a resumed sample runs alone as "#k.s".
    routes: dict[str, tuple[int, int]] = field(default_factory=dict)
    num_events: int = 0  # events written to the request's stream so far (by this run and any before)
    error: Exception | None = None  # InvalidRequest (refused), EngineFailure or HandedBack
    first_token_at: float | None = None
    done: threading.Event = field(default_factory=threading.Event)
    on_done: Callable[["Job"], None] | None = None  # called once it has ended (the engine process reports it)

    def finish(self, error: Exception | None = None) -> None:
        """It has ended (with `error`, or its outputs complete and written): wake whoever waits."""
        if error is not None:
            self.error = error
        self.done.set()
        if self.on_done is not None:
            self.on_done(self)

    def result(self, timeout: float | None, cancel: Callable[[str], None]) -> "Job":
        """Wait for its end and return it, or raise what it ended with. Past `timeout` it is cancelled
        with `cancel(request_id)` and waited for again (it ends at the engine's next step)."""
        if not self.done.wait(timeout):
            cancel(self.request_id)
            self.done.wait()
        if self.error is not None:
            raise self.error
        return self

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for outs in self.outputs for o in outs)

    @property
    def cancelled(self) -> bool:
        return any(o.finish_reason == "abort" for outs in self.outputs for o in outs)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(len(o.token_ids) for outs in self.outputs for o in outs)


def output_so_far(choice: ChoiceProgress | None, index: int) -> CompletionOutput:
    """Sample `index`'s output as an interrupted run streamed it (empty if it streamed nothing)."""
    if choice is None:
        return CompletionOutput(index)
    logprobs = None
    if choice.logprobs is not None:
        logprobs = [TokenLogprob(lp["token_id"], lp["logprob"], tuple(tuple(pair) for pair in lp["top"]))
                    for lp in choice.logprobs]
    return CompletionOutput(index, choice.text, list(choice.token_ids), logprobs, choice.finish_reason)


def one_sample(params: SamplingParams, sample: int) -> SamplingParams:
    """Sample `sample` of n as a request of its own (seeded as the engine seeds a request's samples)."""
    seed = params.seed + sample if params.seed is not None and params.seed + sample < 1 << 64 else params.seed
    return replace(params, n=1, seed=seed)
