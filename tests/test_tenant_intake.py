"""The worker's threads shared between tenants, on a real Redis server: a tenant at its limit has its
work parked, parked work goes back to the broker in fair order when a thread frees, and Redis away
never loses work."""
from __future__ import annotations

import threading
import uuid

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from workers.tenant_intake import TenantIntake
from workers.work import Work


@pytest.fixture(scope="module")
def client(redis_url):
    return redis.Redis.from_url(redis_url)


@pytest.fixture
def sent():
    return []


def make_intake(client, sent, threads=4, tenant_threads=2, weights=None, model=None):
    weights = weights or {}
    return TenantIntake(client, model or f"m-{uuid.uuid4().hex[:8]}", threads, tenant_threads,
                        lambda t: weights.get(t, 1.0), sent.append)


class Holder:
    """Holds a turn open in a thread until released, as a running task does."""

    def __init__(self, intake, tenant, work):
        self.entered = threading.Event()
        self.release = threading.Event()
        self.admitted = None
        self.thread = threading.Thread(target=self._run, args=(intake, tenant, work), daemon=True)
        self.thread.start()
        assert self.entered.wait(5)

    def _run(self, intake, tenant, work):
        with intake.turn(tenant, work) as now:
            self.admitted = now
            self.entered.set()
            self.release.wait(5)

    def end(self):
        self.release.set()
        self.thread.join(5)


def test_a_tenant_at_its_limit_is_parked_and_others_still_run(client, sent):
    intake = make_intake(client, sent)
    a1, a2 = (Holder(intake, "a", Work("llmq.complete", f"a{i}")) for i in (1, 2))
    assert a1.admitted and a2.admitted
    with intake.turn("a", Work("llmq.complete", "a3")) as now:
        assert now is False
    with intake.turn("b", Work("llmq.complete", "b1")) as now:
        assert now is True
        assert intake.in_flight() == {"a": 2, "b": 1}
    assert intake.parked() == {"a": 1}
    assert sent == []  # b's end frees a thread, but a is still at its limit
    a1.end()
    assert sent == [Work("llmq.complete", "a3")]
    assert intake.parked() == {}
    a2.end()
    assert intake.in_flight() == {}


def test_parked_work_goes_back_api_requests_first_then_oldest_first(client, sent):
    intake = make_intake(client, sent, threads=8, tenant_threads=1)
    holder = Holder(intake, "a", Work("llmq.complete", "first"))
    works = [Work("llmq.run_batch_item", 1, 6), Work("llmq.complete", "api-1"),
             Work("llmq.run_batch_item", 2, 6), Work("llmq.complete", "api-2")]
    for work in works:
        with intake.turn("a", work) as now:
            assert not now
    holder.end()
    for _ in range(3):
        with intake.turn("a", Work("llmq.complete", "again")):
            pass  # each end sends one more
    assert [w.arg for w in sent] == ["api-1", "api-2", 1, 2]
    assert sent[2] == Work("llmq.run_batch_item", 1, 6)


def test_a_batchs_lines_go_back_in_the_order_parked(client, sent):
    intake = make_intake(client, sent, threads=100, tenant_threads=100)
    order = [10, 9, 100, 1, 55, 54, 1000, 2]  # not the order of their encodings
    intake.park("a", *(Work("llmq.run_batch_item", i, 6) for i in order[:4]))
    intake.park("a", *(Work("llmq.run_batch_item", i, 6) for i in order[4:]))
    assert intake.resume(limit=100) == len(order)
    assert [w.arg for w in sent] == order


def test_the_tenant_with_fewest_threads_for_its_weight_goes_first(client, sent):
    intake = make_intake(client, sent, threads=10, tenant_threads=3, weights={"heavy": 4.0})
    for tenant in ("heavy", "light"):
        intake.park(tenant, Work("llmq.complete", f"{tenant}-1"))
        intake.park(tenant, Work("llmq.complete", f"{tenant}-2"))
    holders = [Holder(intake, "heavy", Work("llmq.complete", "h")),
               Holder(intake, "light", Work("llmq.complete", "l"))]
    # Each holds 1 thread: 1/4 for heavy, 1/1 for light. Heavy's go first (3/4 after both is still under 1).
    assert intake.resume(limit=4) == 4
    assert [w.arg for w in sent] == ["heavy-1", "heavy-2", "light-1", "light-2"]
    for h in holders:
        h.end()


def test_idle_threads_take_parked_work_up_to_each_tenants_limit(client, sent):
    intake = make_intake(client, sent, threads=3, tenant_threads=2)
    for i in range(5):
        intake.park("a", Work("llmq.complete", f"a{i}"))
    intake.park("b", Work("llmq.complete", "b0"))
    assert intake.resume_idle() == 3  # 3 idle threads; a may take 2 of them
    assert sorted(w.arg for w in sent) == ["a0", "a1", "b0"]
    assert intake.parked() == {"a": 3}


def test_redis_away_runs_the_work_rather_than_lose_it(sent):
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    intake = make_intake(dead, sent, threads=2, tenant_threads=1)
    holder = Holder(intake, "a", Work("llmq.complete", "a1"))
    with intake.turn("a", Work("llmq.complete", "a2")) as now:
        assert now is True  # nowhere to park it
    holder.end()
    assert intake.resume_idle() == 0 and intake.in_flight() == {}


def test_work_that_cannot_be_sent_stays_parked(client):
    def broker_down(work):
        raise ConnectionError("broker away")

    intake = TenantIntake(client, f"m-{uuid.uuid4().hex[:8]}", 4, 2, lambda t: 1.0, broker_down)
    intake.park("a", Work("llmq.complete", "a1"))
    assert intake.resume_idle() == 0
    assert intake.parked() == {"a": 1}


def test_while_the_engine_is_saturated_only_a_tenant_with_nothing_here_starts(client, sent):
    saturated = threading.Event()
    intake = TenantIntake(client, f"m-{uuid.uuid4().hex[:8]}", 8, 4, lambda t: 1.0, sent.append,
                          saturated=saturated.is_set)
    a1 = Holder(intake, "a", Work("llmq.complete", "a1"))
    saturated.set()
    with intake.turn("a", Work("llmq.complete", "a2")) as now:
        assert now is False, "a has work here already: it waits parked, under its limit though it is"
    with intake.turn("b", Work("llmq.complete", "b1")) as now:
        assert now is True, "b has nothing here: it starts, and the engine's fair share gives it a slot"
        with intake.turn("b", Work("llmq.complete", "b2")) as again:
            assert again is False
    assert sent == [Work("llmq.complete", "b2")], "b1 ended: b has nothing here again, so its next goes back"
    assert intake.resume_idle() == 0, "a's work is not sent back to be parked again"
    saturated.clear()
    assert intake.resume_idle() == 1
    assert sent == [Work("llmq.complete", "b2"), Work("llmq.complete", "a2")]
    a1.end()
