"""The metrics contract (llmq/metrics.py) and a worker's recorder of its requests' timings
(workers/request_metrics.py), exactly: which bucket each observation lands in, what a request's
arrival, scheduling, tokens and end add up to, and what a heartbeat carries.

The in-process service test at the end runs a real EngineService (stories260k, a real Redis) and
reads its stats()["metrics"], as every heartbeat does."""
from __future__ import annotations

import math
from dataclasses import fields

import pytest

from llmq import metrics as m
from llmq.engine.config import EngineConfig
from llmq.engine.counters import EngineCounters
from llmq.sampling_params import SamplingParams
from workers.messages import EngineRequest
from workers.publisher import StreamPublisher
from workers.request_metrics import RequestMetrics
from workers.service import EngineService, load_and_warm

# ---- the contract --------------------------------------------------------------------------------


def test_every_name_is_prefixed_documented_and_bucketed_in_order():
    names = [value for key, value in vars(m).items() if key.isupper() and isinstance(value, str) and key != "PREFIX"]
    assert len(names) == 19  # 13 of vLLM's, 6 of the fleet's
    for name in names:
        assert name.startswith("llmq:") and name in m.HELP and not name.endswith("_total"), name
    assert set(m.HELP) == set(names)
    for bounds in m.HISTOGRAMS.values():
        assert list(bounds) == sorted(set(bounds)) and math.inf not in bounds
    # vLLM's: 22 boundaries for time to first token, 19 between tokens, 21 for request latencies.
    assert (len(m.TTFT_BUCKETS), len(m.ITL_BUCKETS), len(m.REQUEST_LATENCY_BUCKETS)) == (22, 19, 21)
    assert (m.TTFT_BUCKETS[0], m.TTFT_BUCKETS[-1], m.ITL_BUCKETS[-1], m.REQUEST_LATENCY_BUCKETS[-1]) == (
        0.001, 2560.0, 80.0, 7680.0)


def test_the_engine_counters_are_the_contracts_heartbeat_keys():
    assert [f.name for f in fields(EngineCounters)] == [m.heartbeat_key(name) for name in m.ENGINE_COUNTERS]
    assert m.heartbeat_key(m.TIME_TO_FIRST_TOKEN) == "time_to_first_token_seconds"


def test_a_histogram_counts_each_value_in_the_first_bucket_at_or_above_it():
    histogram = m.Histogram((0.1, 1.0, 10.0))
    for value in (0.05, 0.1, 0.5, 1.0, 1.0000001, 10.0, 11.0, 1e9):
        histogram.observe(value)
    assert histogram.counts == [2, 2, 2, 2]  # (.., 0.1], (0.1, 1], (1, 10], (10, +Inf)
    assert histogram.count == 8
    assert histogram.sum == pytest.approx(0.05 + 0.1 + 0.5 + 1.0 + 1.0000001 + 10.0 + 11.0 + 1e9)
    assert histogram.cumulative() == [(0.1, 2), (1.0, 4), (10.0, 6), (math.inf, 8)]


def test_a_histogram_goes_through_a_heartbeat_and_back_only_with_its_own_bounds():
    histogram = m.Histogram((0.1, 1.0))
    histogram.observe(0.5)
    snapshot = histogram.snapshot()
    assert snapshot == {"counts": [0, 1, 0], "sum": 0.5}
    histogram.observe(5.0)
    assert snapshot["counts"] == [0, 1, 0]  # a copy, not the live list
    back = m.Histogram.from_snapshot((0.1, 1.0), snapshot)
    assert (back.counts, back.sum) == ([0, 1, 0], 0.5)
    assert m.Histogram.from_snapshot((0.1, 1.0, 2.0), snapshot) is None  # another version's buckets
    assert m.Histogram.from_snapshot((0.1, 1.0), None) is None
    assert m.Histogram.from_snapshot((0.1, 1.0), {"counts": "x"}) is None


# ---- the recorder --------------------------------------------------------------------------------

def bucket_of(histogram: m.Histogram, value: float) -> list[int]:
    """The counts a histogram with these bounds has after observing just `value`."""
    alone = m.Histogram(histogram.bounds)
    alone.observe(value)
    return alone.counts


def test_one_request_from_arrival_to_its_end():
    metrics = RequestMetrics()
    job = object()
    metrics.arrived(job, 10.0)
    metrics.scheduled(job, 10.5)
    metrics.scheduled(job, 12.0)  # scheduled again (a preempted sequence, another prompt): still 0.5
    # Times a float holds exactly, so each interval is exact too.
    metrics.delta(job, 0, 1, None, 11.0)  # the request's first token: 1 s after it arrived
    metrics.delta(job, 1, 1, None, 11.015625)  # sample 1's first token: neither a first token nor a gap
    metrics.delta(job, 0, 1, None, 11.0625)  # 0.0625 s after sample 0's last
    metrics.delta(job, 1, 1, "length", 11.265625)  # 0.25 s after sample 1's
    metrics.delta(job, 0, 0, "stop", 11.375)  # a last delta with no token: no gap
    metrics.finished(job, 11.5)
    assert metrics.request_queue_time.counts == bucket_of(metrics.request_queue_time, 0.5)
    assert metrics.request_queue_time.counts[m.REQUEST_LATENCY_BUCKETS.index(0.5)] == 1  # le is inclusive
    assert metrics.request_queue_time.sum == 0.5
    assert metrics.time_to_first_token.counts[m.TTFT_BUCKETS.index(1.0)] == 1
    assert metrics.time_to_first_token.count == 1
    assert (metrics.inter_token_latency.count, metrics.inter_token_latency.sum) == (2, 0.0625 + 0.25)
    assert metrics.inter_token_latency.counts[m.ITL_BUCKETS.index(0.075)] == 1  # (0.05, 0.075]
    assert metrics.inter_token_latency.counts[m.ITL_BUCKETS.index(0.3)] == 1  # (0.2, 0.3]
    assert metrics.e2e_request_latency.counts[m.REQUEST_LATENCY_BUCKETS.index(1.5)] == 1
    assert metrics.e2e_request_latency.sum == 1.5
    assert metrics.request_success == {"stop": 1, "length": 1, "abort": 0}
    assert metrics.num_in_flight == 0


def test_a_request_ended_otherwise_counts_in_no_latency_and_is_forgotten():
    metrics = RequestMetrics()
    job = object()
    metrics.arrived(job, 1.0)
    metrics.forget(job)
    metrics.delta(job, 0, 1, "abort", 2.0)  # anything after it belongs to no request
    metrics.finished(job, 3.0)
    assert metrics.num_in_flight == 0
    assert metrics.request_success == {"stop": 0, "length": 0, "abort": 0}
    assert (metrics.time_to_first_token.count, metrics.e2e_request_latency.count,
            metrics.request_queue_time.count) == (0, 0, 0)


def test_requests_are_kept_apart():
    metrics = RequestMetrics()
    first, second = object(), object()
    metrics.arrived(first, 0.0)
    metrics.arrived(second, 1.0)
    metrics.delta(first, 0, 1, None, 2.0)
    metrics.delta(second, 0, 1, None, 2.0)  # second's first token too, not a gap after first's
    metrics.delta(second, 0, 1, "abort", 2.5)
    metrics.finished(second, 2.5)
    assert metrics.time_to_first_token.sum == 2.0 + 1.0 and metrics.time_to_first_token.count == 2
    assert (metrics.inter_token_latency.count, metrics.inter_token_latency.sum) == (1, 0.5)
    assert (metrics.e2e_request_latency.count, metrics.e2e_request_latency.sum) == (1, 1.5)
    assert metrics.num_in_flight == 1


def test_the_snapshot_is_the_heartbeats_form_and_a_copy():
    metrics = RequestMetrics()
    job = object()
    metrics.arrived(job, 0.0)
    metrics.delta(job, 0, 1, "stop", 0.002)
    snapshot = metrics.snapshot()
    assert set(snapshot) == {m.heartbeat_key(m.REQUEST_SUCCESS), *map(m.heartbeat_key, m.HISTOGRAMS)}
    assert snapshot["request_success"] == {"stop": 1, "length": 0, "abort": 0}
    ttft = m.Histogram.from_snapshot(m.TTFT_BUCKETS, snapshot["time_to_first_token_seconds"])
    assert ttft.counts[1] == 1 and ttft.count == 1  # (0.001, 0.005]
    metrics.delta(job, 0, 1, "length", 0.003)
    assert snapshot["request_success"]["length"] == 0


# ---- in the engine service ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def service_factory(stories_dir, redis_url):
    import redis

    made = []

    def make(metrics: bool) -> EngineService:
        service = EngineService(lambda: load_and_warm(EngineConfig(str(stories_dir), dtype="float32", max_num_seqs=8)),
                                StreamPublisher(redis.Redis.from_url(redis_url), maxlen=1000, ttl=60), metrics=metrics)
        service.start()
        made.append(service)
        return service

    yield make
    for service in made:
        service.stop()


def test_the_service_reports_its_requests_in_its_stats(service_factory):
    service = service_factory(metrics=True)
    before = service.stats()["metrics"]
    assert before["generation_tokens"] == before["prompt_tokens"] == 0  # the warm-up is not counted
    assert before["request_success"] == {"stop": 0, "length": 0, "abort": 0}
    prompt = service.tokenizer.encode("Once upon a time")
    two = service.run(EngineRequest("two", [prompt], SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=5,
                                                                    ignore_eos=True)))
    one = service.run(EngineRequest("one", [prompt, prompt[:2]], SamplingParams(temperature=0, max_tokens=3,
                                                                                ignore_eos=True)))
    after = service.stats()["metrics"]
    assert after["generation_tokens"] == two.completion_tokens + one.completion_tokens == 10 + 6
    assert after["prompt_tokens"] == two.prompt_tokens + one.prompt_tokens  # the n samples share their prompt
    assert after["request_success"] == {"stop": 0, "length": 4, "abort": 0}
    histograms = {name: m.Histogram.from_snapshot(bounds, after[m.heartbeat_key(name)])
                  for name, bounds in m.HISTOGRAMS.items()}
    assert histograms[m.TIME_TO_FIRST_TOKEN].count == 2  # one per request
    assert histograms[m.E2E_REQUEST_LATENCY].count == 2
    assert histograms[m.REQUEST_QUEUE_TIME].count == 2
    assert histograms[m.INTER_TOKEN_LATENCY].count == 2 * 4 + 2 * 2  # every token after its sample's first
    assert histograms[m.E2E_REQUEST_LATENCY].sum >= histograms[m.TIME_TO_FIRST_TOKEN].sum > 0


def test_with_metrics_off_the_service_keeps_only_the_engine_counters(service_factory):
    service = service_factory(metrics=False)
    result = service.run(EngineRequest("off", [service.tokenizer.encode("Once")],
                                       SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)))
    assert service.stats()["metrics"] == {"prompt_tokens": result.prompt_tokens, "generation_tokens": 2,
                                          "prefix_cache_queries": result.prompt_tokens, "prefix_cache_hits": 0,
                                          "num_preemptions": 0}
