"""RequestMetrics: how a worker's requests went since it started, for GET /metrics (the names are
llmq/metrics.py's): time to first token, the time between tokens, end-to-end latency and the time a
request waited in the engine before it was first scheduled, as histograms; and the samples that
finished, by reason.

The engine loop tells it what happened and when (`time.perf_counter()`, one clock for every
interval): a request arrived, was first scheduled, a sample got tokens or finished, the request
finished, or ended some other way (an error, handed back: `forget`, so it counts in no latency). Each
call is a dict lookup or two and an add, cheap enough for every token on the loop.

Only the loop thread calls those; `snapshot()` may come from any thread (a heartbeat, the engine
process's pipe reader) without a lock: it copies each list and dict in one step, which the
interpreter lock makes whole, so a snapshot never shows a bucket's count going back. A histogram's
sum may lag its counts by the one observation being made, which the next snapshot has.
"""
from __future__ import annotations

from collections.abc import Hashable

from llmq.metrics import (
    E2E_REQUEST_LATENCY,
    FINISHED_REASONS,
    INTER_TOKEN_LATENCY,
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    REQUEST_QUEUE_TIME,
    REQUEST_SUCCESS,
    TIME_TO_FIRST_TOKEN,
    TTFT_BUCKETS,
    Histogram,
    heartbeat_key,
)


class _Timing:
    """One request in flight: when it arrived, and each of its samples' last token."""

    __slots__ = ("arrived_at", "waiting", "before_first_token", "last_token_at")

    def __init__(self, arrived_at: float):
        self.arrived_at = arrived_at
        self.waiting = True  # not scheduled yet
        self.before_first_token = True
        self.last_token_at: dict[Hashable, float] = {}  # by sample


class RequestMetrics:
    def __init__(self):
        self.time_to_first_token = Histogram(TTFT_BUCKETS)
        self.inter_token_latency = Histogram(ITL_BUCKETS)
        self.e2e_request_latency = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_success = dict.fromkeys(FINISHED_REASONS, 0)  # every reason there from the start
        self._requests: dict[Hashable, _Timing] = {}

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    def arrived(self, request: Hashable, at: float) -> None:
        self._requests[request] = _Timing(at)

    def scheduled(self, request: Hashable, at: float) -> None:
        """The engine scheduled one of the request's sequences; the first time ends its queue time."""
        timing = self._requests.get(request)
        if timing is not None and timing.waiting:
            timing.waiting = False
            self.request_queue_time.observe(at - timing.arrived_at)

    def delta(self, request: Hashable, sample: Hashable, num_tokens: int, finish_reason: str | None,
              at: float) -> None:
        """A sample of the request got `num_tokens` tokens at `at` (and finished, with a reason)."""
        timing = self._requests.get(request)
        if timing is None:
            return
        if num_tokens:
            last = timing.last_token_at.get(sample)
            if last is not None:
                self.inter_token_latency.observe(at - last)
            elif timing.before_first_token:  # the request's first token, of whichever sample
                timing.before_first_token = False
                self.time_to_first_token.observe(at - timing.arrived_at)
            timing.last_token_at[sample] = at
        if finish_reason is not None:
            self.request_success[finish_reason] = self.request_success.get(finish_reason, 0) + 1
            timing.last_token_at.pop(sample, None)

    def finished(self, request: Hashable, at: float) -> None:
        """Every sample of the request has finished: its end-to-end latency."""
        timing = self._requests.pop(request, None)
        if timing is not None:
            self.e2e_request_latency.observe(at - timing.arrived_at)

    def forget(self, request: Hashable) -> None:
        """The request ended without finishing (an error, handed back): no latency of its counts."""
        self._requests.pop(request, None)

    def snapshot(self) -> dict:
        """The heartbeat's form of these figures (llmq/metrics.py)."""
        return {heartbeat_key(REQUEST_SUCCESS): dict(self.request_success),
                heartbeat_key(TIME_TO_FIRST_TOKEN): self.time_to_first_token.snapshot(),
                heartbeat_key(INTER_TOKEN_LATENCY): self.inter_token_latency.snapshot(),
                heartbeat_key(E2E_REQUEST_LATENCY): self.e2e_request_latency.snapshot(),
                heartbeat_key(REQUEST_QUEUE_TIME): self.request_queue_time.snapshot()}
