"""The metrics contract: every name GET /metrics exports, its labels and histogram buckets, and how a
worker's heartbeat carries its figures there. Dashboards (deploy/grafana) and autoscaling queries
(deploy/kubernetes, KEDA) are written against these names; change one and they break.

The names and the histograms' bucket boundaries are vLLM's (vllm/v1/metrics/loggers.py), under the
`llmq:` prefix instead of `vllm:`, so a dashboard or query written for one reads the other with the
prefix changed. Every per-worker series is labelled `model_name` and `worker`; counters are exported
with Prometheus's `_total` suffix, histograms as `_bucket`, `_sum` and `_count`.

The web renders them on each scrape from what Redis and the database hold (app/fleet_metrics.py),
never from its own memory, so any of several web processes answers for the whole fleet. A worker
sends its cumulative figures in every heartbeat under "metrics" (workers/request_metrics.py):

  {"prompt_tokens": int, "generation_tokens": int, "prefix_cache_queries": int,
   "prefix_cache_hits": int, "num_preemptions": int,            the engine's counters
   "request_success": {finished_reason: int},                    (llmq/engine/counters.py)
   "time_to_first_token_seconds": {"counts": [int, ...], "sum": float}, ...}

A histogram's `counts` has one entry per bucket and a last one for +Inf, each counting only the
observations that fell in its own bucket (not cumulative): the web adds them up.
Plain Python: imported by the web and the workers alike (no Flask, Celery, torch or prometheus_client).
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

PREFIX = "llmq:"
WORKER_LABELS = ("model_name", "worker")

# ---- per worker, from its heartbeat ------------------------------------------------------------

NUM_REQUESTS_RUNNING = "llmq:num_requests_running"
NUM_REQUESTS_WAITING = "llmq:num_requests_waiting"
KV_CACHE_USAGE_PERC = "llmq:kv_cache_usage_perc"  # 0..1: 1 - free blocks / total blocks

# Counters, named without "_total" (Prometheus's client adds it on the way out, as vLLM's does).
PROMPT_TOKENS = "llmq:prompt_tokens"
GENERATION_TOKENS = "llmq:generation_tokens"
PREFIX_CACHE_QUERIES = "llmq:prefix_cache_queries"
PREFIX_CACHE_HITS = "llmq:prefix_cache_hits"
NUM_PREEMPTIONS = "llmq:num_preemptions"
REQUEST_SUCCESS = "llmq:request_success"  # labelled finished_reason as well
FINISHED_REASONS = ("stop", "length", "abort")

TIME_TO_FIRST_TOKEN = "llmq:time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "llmq:inter_token_latency_seconds"
E2E_REQUEST_LATENCY = "llmq:e2e_request_latency_seconds"
REQUEST_QUEUE_TIME = "llmq:request_queue_time_seconds"

# vLLM's boundaries, so the two read alike in one dashboard.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# The heartbeat key of each counter and histogram: the metric's name without the prefix.
ENGINE_COUNTERS = (PROMPT_TOKENS, GENERATION_TOKENS, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, NUM_PREEMPTIONS)
HISTOGRAMS = {TIME_TO_FIRST_TOKEN: TTFT_BUCKETS, INTER_TOKEN_LATENCY: ITL_BUCKETS,
              E2E_REQUEST_LATENCY: REQUEST_LATENCY_BUCKETS, REQUEST_QUEUE_TIME: REQUEST_LATENCY_BUCKETS}

# ---- the fleet's, from Redis and the database --------------------------------------------------

QUEUE_DEPTH = "llmq:queue_depth"  # model_name, priority: broker messages + parked work (llmq.fleet.queue_depth)
WORKERS = "llmq:workers"  # model_name, state (llmq.fleet.WORKER_STATES)
AUTOSCALER_DESIRED_WORKERS = "llmq:autoscaler_desired_workers"  # model_name
AUTOSCALER_ACTUAL_WORKERS = "llmq:autoscaler_actual_workers"  # model_name
BATCHES = "llmq:batches"  # status: every BatchStatus, 0 where none
BATCH_LINES_DONE = "llmq:batch_lines_done"  # status: every terminal ItemStatus (a counter)

HELP = {
    NUM_REQUESTS_RUNNING: "Requests in the worker's running batch.",
    NUM_REQUESTS_WAITING: "Requests waiting in the worker's engine to be scheduled.",
    KV_CACHE_USAGE_PERC: "KV-cache usage: the fraction of the worker's KV blocks in use (1 means all).",
    PROMPT_TOKENS: "Prompt tokens of the requests the worker prefilled, counted once each when its first "
                   "token is made.",
    GENERATION_TOKENS: "Tokens the worker generated.",
    PREFIX_CACHE_QUERIES: "Prefix cache queries, in tokens: the tokens of every sequence admitted while prefix "
                          "caching is on.",
    PREFIX_CACHE_HITS: "Prefix cache hits, in tokens: the tokens of admitted sequences found in the cache.",
    NUM_PREEMPTIONS: "Sequences the worker's engine preempted (sent back to waiting, their KV freed).",
    REQUEST_SUCCESS: "Samples (choices) that finished, by finished_reason.",
    TIME_TO_FIRST_TOKEN: "Time from a request reaching the worker's engine service to its first token, in seconds.",
    INTER_TOKEN_LATENCY: "Time between a sample's consecutive tokens, in seconds.",
    E2E_REQUEST_LATENCY: "Time from a request reaching the worker's engine service to its last token, in seconds.",
    REQUEST_QUEUE_TIME: "Time a request waited in the worker's engine before it was first scheduled, in seconds.",
    QUEUE_DEPTH: "Requests waiting for a worker: the model's broker queue and the work parked for its tenant's "
                 "turn, by broker priority level.",
    WORKERS: "Live workers (a heartbeat within 3 x LLMQ_HEARTBEAT_SECONDS + 5 s), by state.",
    AUTOSCALER_DESIRED_WORKERS: "The workers the autoscaler last decided the model needs.",
    AUTOSCALER_ACTUAL_WORKERS: "The workers the autoscaler last saw running for the model.",
    BATCHES: "Batches in the database, by status.",
    BATCH_LINES_DONE: "Batch lines in a terminal state, by status.",
}


def heartbeat_key(name: str) -> str:
    """A counter's or histogram's key in the heartbeat's "metrics": its name without the prefix."""
    return name[len(PREFIX):]


@dataclass(eq=False)
class Histogram:
    """Observations counted into fixed buckets, as Prometheus histograms are: plain Python, cheap
    enough to observe per token. `counts[i]` counts values <= bounds[i] and above bounds[i - 1];
    the last entry, values above every bound."""

    bounds: tuple[float, ...]
    counts: list[int] | None = None  # default: all zero
    sum: float = 0.0

    def __post_init__(self) -> None:
        if self.counts is None:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def snapshot(self) -> dict:
        """The heartbeat's form (see the module docstring)."""
        return {"counts": list(self.counts), "sum": self.sum}

    @classmethod
    def from_snapshot(cls, bounds: tuple[float, ...], snapshot: dict) -> "Histogram | None":
        """Back from a heartbeat; None if it does not fit these bounds (a worker of another version)."""
        counts = snapshot.get("counts") if isinstance(snapshot, dict) else None
        if not isinstance(counts, list) or len(counts) != len(bounds) + 1:
            return None
        return cls(bounds, [int(c) for c in counts], float(snapshot.get("sum", 0.0)))

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it) for every bucket, +Inf (math.inf) last."""
        out, total = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            total += count
            out.append((bound, total))
        return out
