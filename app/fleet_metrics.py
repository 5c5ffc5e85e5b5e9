"""FleetCollector: the whole fleet as Prometheus metric families, made afresh on every scrape of
GET /metrics from what Redis holds (the workers' heartbeats, each model's waiting work, the
autoscaler's decisions; llmq/fleet.py) and what the database holds (batches, batch lines). The web
keeps nothing between scrapes, so each of several web processes answers for the whole fleet and
they all answer alike. The names, labels and buckets are llmq/metrics.py's.

A worker's series are labelled with its model and its name, and last as long as its heartbeats do:
one that stops beating (3 x LLMQ_HEARTBEAT_SECONDS + 5 s) drops out, and one that restarts begins its
counters again from zero, which Prometheus's rate() takes as a reset.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString
from sqlalchemy import func, select

from llmq import metrics as m
from llmq.fleet import PRIORITY_STEPS, WORKER_STATES, autoscalers, live_workers, queue_depth
from llmq.store.database import Database
from llmq.store.models import TERMINAL_ITEM_STATES, Batch, BatchItem, BatchStatus


class FleetCollector:
    """`models`: the models to report queue depth for even when no worker serves them (the one this
    web serves, which an autoscaler may be about to start workers for); `stale_after`: how old a
    heartbeat or an autoscaler's decision may be and still count."""

    def __init__(self, client: redis.Redis, db: Database, models: Iterable[str], stale_after: float):
        self.client, self.db, self.models, self.stale_after = client, db, tuple(models), stale_after

    def collect(self) -> Iterator[Metric]:
        now = time.time()
        workers = live_workers(self.client, self.stale_after, now=now)
        decisions = autoscalers(self.client, self.stale_after, now=now)
        models = sorted({*self.models, *decisions, *(w["model"] for w in workers if "model" in w)})
        yield from worker_families(workers)
        yield self._queue_depth(models)
        yield workers_by_state(models, workers)
        yield from autoscaler_families(decisions)
        yield from self._database_families()

    def _queue_depth(self, models: list[str]) -> GaugeMetricFamily:
        family = GaugeMetricFamily(m.QUEUE_DEPTH, m.HELP[m.QUEUE_DEPTH], labels=["model_name", "priority"])
        for model in models:
            depth = queue_depth(self.client, model)
            for step in PRIORITY_STEPS:
                family.add_metric([model, str(step)], depth.get(step, 0))
        return family

    def _database_families(self) -> Iterator[Metric]:
        with self.db.read() as session:
            batches = dict(session.execute(select(Batch.status, func.count()).group_by(Batch.status)).all())
            lines = dict(session.execute(select(BatchItem.status, func.count())
                                         .where(BatchItem.status.in_(TERMINAL_ITEM_STATES))
                                         .group_by(BatchItem.status)).all())
        by_status = GaugeMetricFamily(m.BATCHES, m.HELP[m.BATCHES], labels=["status"])
        for status in BatchStatus:
            by_status.add_metric([status.value], batches.get(status.value, 0))
        yield by_status
        done = CounterMetricFamily(m.BATCH_LINES_DONE, m.HELP[m.BATCH_LINES_DONE], labels=["status"])
        for status in TERMINAL_ITEM_STATES:
            done.add_metric([status.value], lines.get(status.value, 0))
        yield done


def worker_families(workers: list[dict]) -> Iterator[Metric]:
    """Each live worker's load (gauges) and what it reported under "metrics" (counters, histograms)."""
    def family(kind, name: str, extra_labels: tuple[str, ...] = ()):
        return kind(name, m.HELP[name], labels=[*m.WORKER_LABELS, *extra_labels])

    running, waiting = family(GaugeMetricFamily, m.NUM_REQUESTS_RUNNING), family(GaugeMetricFamily,
                                                                                 m.NUM_REQUESTS_WAITING)
    kv_usage = family(GaugeMetricFamily, m.KV_CACHE_USAGE_PERC)
    counters = {name: family(CounterMetricFamily, name) for name in m.ENGINE_COUNTERS}
    success = family(CounterMetricFamily, m.REQUEST_SUCCESS, ("finished_reason",))
    histograms = {name: family(HistogramMetricFamily, name) for name in m.HISTOGRAMS}
    for beat in workers:
        labels = [beat.get("model", ""), beat["name"]]
        if "running" in beat:  # a worker still loading its engine reports no load yet
            running.add_metric(labels, beat["running"])
            waiting.add_metric(labels, beat.get("waiting", 0))
        if beat.get("total_blocks"):
            kv_usage.add_metric(labels, 1 - beat.get("free_blocks", 0) / beat["total_blocks"])
        reported = beat.get("metrics") or {}
        for name, counter in counters.items():
            if m.heartbeat_key(name) in reported:
                counter.add_metric(labels, reported[m.heartbeat_key(name)])
        ended = reported.get(m.heartbeat_key(m.REQUEST_SUCCESS))
        if isinstance(ended, dict):
            for reason in sorted({*m.FINISHED_REASONS, *ended}):
                success.add_metric([*labels, reason], ended.get(reason, 0))
        for name, histogram in histograms.items():
            observed = m.Histogram.from_snapshot(m.HISTOGRAMS[name], reported.get(m.heartbeat_key(name)))
            if observed is not None:
                buckets = [(floatToGoString(bound), count) for bound, count in observed.cumulative()]
                histogram.add_metric(labels, buckets, sum_value=observed.sum)
    yield from (running, waiting, kv_usage, *counters.values(), success, *histograms.values())


def workers_by_state(models: list[str], workers: list[dict]) -> GaugeMetricFamily:
    """Every model's live workers in every state (0 where none); a heartbeat without a state is ready."""
    counts = Counter((w.get("model", ""), w.get("state", "ready")) for w in workers)
    family = GaugeMetricFamily(m.WORKERS, m.HELP[m.WORKERS], labels=["model_name", "state"])
    for model in models:
        for state in sorted({*WORKER_STATES, *(s for mod, s in counts if mod == model)}, key=_state_order):
            family.add_metric([model, state], counts[(model, state)])
    return family


def _state_order(state: str) -> tuple[int, str]:
    return (WORKER_STATES.index(state) if state in WORKER_STATES else len(WORKER_STATES), state)


def autoscaler_families(decisions: dict[str, dict]) -> Iterator[GaugeMetricFamily]:
    """The autoscaler's latest decision for each model it sizes: the workers it wants, and those it saw."""
    for name, key in ((m.AUTOSCALER_DESIRED_WORKERS, "desired"), (m.AUTOSCALER_ACTUAL_WORKERS, "actual")):
        family = GaugeMetricFamily(name, m.HELP[name], labels=["model_name"])
        for model, decision in sorted(decisions.items()):
            if key in decision:
                family.add_metric([model], decision[key])
        yield family
