"""Job: an EngineRequest's routing state inside the engine service, and how its end reaches the
thread that waits for it (Outcome).

A job holds each prompt's n outputs as the engine makes them. A job that resumes an interrupted run
starts from what the request's stream holds: each choice's text, tokens and logprobs so far, and
each unfinished sample runs as an engine request of its own (`one_sample`), since samples of one
prompt no longer share their position.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from llmq.outputs import CompletionOutput
from llmq.sampling_params import SamplingParams
from workers.messages import EngineError, EngineRequest, EngineResult


class Outcome:
    """How a run ended, set once by whoever ends it, for the thread that waits on it."""

    def __init__(self):
        self._done = threading.Event()
        self.result: EngineResult | None = None
        self.error: EngineError | None = None

    def set(self, result: EngineResult | None, error: EngineError | None) -> None:
        self.result, self.error = result, error
        self._done.set()

    def done(self, timeout: float | None = 0) -> bool:
        """Whether it has ended (waiting up to `timeout` seconds for it; None: until it has)."""
        return self._done.wait(timeout)

    def wait(self, request_id: str, timeout: float | None, cancel: Callable[[str], None]) -> EngineResult:
        """The result, or raise what the run ended with. Past `timeout` the run is cancelled with
        `cancel(request_id)` and waited for again (it ends at the engine's next step)."""
        if not self._done.wait(timeout):
            cancel(request_id)
            self._done.wait()
        if self.error is not None:
            raise self.error
        return self.result


@dataclass(eq=False)  # identity: jobs key the per-step event map
class Job:
    """One EngineRequest (possibly several prompts, each with n samples) in the engine."""

    request: EngineRequest
    outputs: list[list[CompletionOutput]] = field(default_factory=list)  # [prompt][sample]
    # Engine request id -> (prompt number, its first sample): "#k" runs prompt k's n samples together;
    # a resumed sample runs alone as "#k.s".
    routes: dict[str, tuple[int, int]] = field(default_factory=dict)
    num_events: int = 0  # events written to the request's stream so far (by this run and any before)
    first_token_at: float | None = None
    arrived_at: float = 0.0  # when it reached the engine service (time.perf_counter(); for its metrics)
    outcome: Outcome = field(default_factory=Outcome)
    on_done: Callable[["Job"], None] | None = None  # called once it has ended (the engine process reports it)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def finish(self, error: EngineError | None = None) -> None:
        """It has ended (with `error`, or its outputs complete and written): wake whoever waits."""
        self.outcome.set(None if error is not None else self.result(), error)
        if self.on_done is not None:
            self.on_done(self)

    def result(self) -> EngineResult:
        return EngineResult(tuple(tuple(outs) for outs in self.outputs), self.request.prompts, self.first_token_at)

    @property
    def max_events(self) -> int:
        """The most events the request's stream can hold, over every run of it: per choice a delta a
        token and one that ends it (an abort brings no token), plus one per resumption, and its end."""
        choices = len(self.request.prompts) * self.params.n
        return choices * (self.params.max_tokens + 2) + 1

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for outs in self.outputs for o in outs)

    @property
    def prompt_tokens(self) -> int:
        return self.result().prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return self.result().completion_tokens


def output_so_far(choice: CompletionOutput | None, index: int) -> CompletionOutput:
    """Sample `index`'s output as an interrupted run streamed it (empty if it streamed nothing)."""
    if choice is None:
        return CompletionOutput(index)
    logprobs = None if choice.logprobs is None else list(choice.logprobs)
    return CompletionOutput(index, choice.text, list(choice.token_ids), logprobs, choice.finish_reason)


def one_sample(params: SamplingParams, sample: int) -> SamplingParams:
    """Sample `sample` of n as a request of its own (seeded as the engine seeds a request's samples)."""
    seed = params.seed + sample if params.seed is not None and params.seed + sample < 1 << 64 else params.seed
    return replace(params, n=1, seed=seed)
