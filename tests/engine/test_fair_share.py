"""Fair share between tenants, exactly: the split of a step's slots and tokens (fair_split), and what
the scheduler does with it. Simulated steps as in test_scheduler.py; block size 4 throughout."""

import pytest

from llmq.engine.block_manager import BlockManager
from llmq.engine.fair_share import fair_split
from llmq.engine.scheduler import Scheduler
from llmq.engine.sequence import Sequence
from llmq.sampling_params import SamplingParams

# ---- fair_split --------------------------------------------------------------------------------


@pytest.mark.parametrize("capacity, demands, weights, expected", [
    (8, {"a": 100, "b": 100}, {}, {"a": 4, "b": 4}),
    (8, {"a": 100, "b": 1}, {}, {"a": 7, "b": 1}),  # what b leaves goes to a
    (8, {"a": 100}, {}, {"a": 8}),  # alone: everything
    (8, {"a": 3, "b": 2}, {}, {"a": 3, "b": 2}),  # room for all: all they ask
    (9, {"a": 100, "b": 100}, {"a": 2.0}, {"a": 6, "b": 3}),
    (10, {"a": 100, "b": 100, "c": 100}, {}, {"a": 4, "b": 3, "c": 3}),  # the spare one to the first name
    (10, {"a": 100, "b": 100, "c": 2}, {}, {"a": 4, "b": 4, "c": 2}),
    (12, {"a": 100, "b": 5, "c": 100}, {"c": 3.0}, {"a": 3, "b": 2, "c": 7}),  # a and b tie: a has the spare
    (5, {"a": 0, "b": -3, "c": 9}, {}, {"a": 0, "b": 0, "c": 5}),
    (0, {"a": 4}, {}, {"a": 0}),
])
def test_fair_split(capacity, demands, weights, expected):
    assert fair_split(capacity, demands, weights) == expected


@pytest.mark.parametrize("capacity", [1, 7, 64, 2048])
def test_fair_split_gives_out_everything_that_is_asked_for_and_no_more(capacity):
    demands = {"a": 5, "b": 300, "c": 17, "d": 1, "e": 0}
    weights = {"a": 0.5, "b": 1.0, "c": 4.0, "d": 1.0}
    parts = fair_split(capacity, demands, weights)
    assert sum(parts.values()) == min(capacity, sum(demands.values()))
    assert all(0 <= parts[t] <= max(0, demands[t]) for t in demands)


# ---- the scheduler -----------------------------------------------------------------------------

BLOCK_SIZE = 4


def make_scheduler(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64):
    return Scheduler(BlockManager(num_blocks, BLOCK_SIZE, True), max_num_seqs, max_num_batched_tokens)


def make_seq(request_id, tenant, prompt_len=3, weight=1.0, priority=0, n=1, start=None):
    start = hash(request_id) % 1000 * 100 if start is None else start
    return Sequence(request_id, list(range(start, start + prompt_len)), SamplingParams(n=n, max_tokens=100),
                    tenant=tenant, weight=weight, priority=priority)


def step(sched):
    batch = sched.schedule()
    sched.postprocess(batch, [7] * len(batch.samplers))
    return batch


def running_by_tenant(sched):
    return {t: running for t, (running, _) in sched.tenant_load().items()}


def test_a_tenant_alone_uses_every_slot():
    sched = make_scheduler()
    for i in range(10):
        sched.add(make_seq(f"a{i}", "a"))
    step(sched)
    assert running_by_tenant(sched) == {"a": 4}
    assert sched.num_waiting == 6


def test_a_newcomer_takes_a_slot_from_the_tenant_over_its_share_in_the_same_step():
    sched = make_scheduler()
    flood = [make_seq(f"a{i}", "a") for i in range(10)]
    for seq in flood:
        sched.add(seq)
    step(sched)
    step(sched)
    b = make_seq("b0", "b")
    sched.add(b)
    batch = step(sched)
    assert batch.preempted == [flood[3]]  # a's newest running sequence gives way
    assert b in batch.seqs and b in batch.samplers
    assert running_by_tenant(sched) == {"a": 3, "b": 1}
    assert sched.waiting[0] is flood[3]  # and is a's next in line


def test_two_flooding_tenants_share_the_slots_equally_whoever_came_first():
    sched = make_scheduler()
    for i in range(6):
        sched.add(make_seq(f"a{i}", "a"))
    step(sched)
    for i in range(6):
        sched.add(make_seq(f"b{i}", "b"))
    step(sched)
    assert running_by_tenant(sched) == {"a": 2, "b": 2}


def test_weights_set_the_shares():
    sched = make_scheduler(max_num_seqs=8)
    for i in range(10):
        sched.add(make_seq(f"a{i}", "a", weight=3.0))
        sched.add(make_seq(f"b{i}", "b"))
    step(sched)
    assert running_by_tenant(sched) == {"a": 6, "b": 2}


def test_a_tenant_under_its_share_is_admitted_before_earlier_work_of_one_over_it():
    sched = make_scheduler(max_num_seqs=3)
    a = [make_seq(f"a{i}", "a") for i in range(4)]
    for seq in a[:2]:
        sched.add(seq)
    step(sched)
    sched.add(a[2])
    sched.add(a[3])
    b = make_seq("b0", "b")
    sched.add(b)  # after a[2] and a[3]; a holds 2 slots, b's share is 1
    batch = step(sched)
    assert batch.preempted == []
    assert b in batch.seqs and a[2] not in batch.seqs
    assert running_by_tenant(sched) == {"a": 2, "b": 1}


def test_priority_orders_a_tenants_own_work_only():
    sched = make_scheduler(max_num_seqs=2)
    a_batch = make_seq("a-batch", "a", priority=1)
    a_api = make_seq("a-api", "a", priority=0)
    b_batch = make_seq("b-batch", "b", priority=1)
    for seq in (a_batch, b_batch, a_api):
        sched.add(seq)
    batch = step(sched)
    assert set(batch.seqs) == {a_api, b_batch}  # a's API request before a's batch line; b still gets its share


def test_a_long_prefill_leaves_the_other_tenant_its_share_of_the_token_budget():
    sched = make_scheduler(max_num_batched_tokens=16, num_blocks=256)
    long = make_seq("a-long", "a", prompt_len=200)
    sched.add(long)
    assert step(sched).num_new_tokens == [16]  # alone: the whole budget
    b = make_seq("b0", "b", prompt_len=6)
    sched.add(b)
    batch = step(sched)
    assert dict(zip(batch.seqs, batch.num_new_tokens)) == {long: 10, b: 6}  # b's 6 are within its half
    batch = step(sched)
    assert dict(zip(batch.seqs, batch.num_new_tokens)) == {long: 15, b: 1}  # b decodes; a gets the rest


def test_out_of_blocks_the_victim_is_from_the_tenant_using_most_slots_for_its_weight():
    sched = make_scheduler(num_blocks=4, max_num_seqs=8)
    b = make_seq("b0", "b", prompt_len=3)
    sched.add(b)
    step(sched)
    a = [make_seq(f"a{i}", "a", prompt_len=3) for i in range(3)]
    for seq in a:
        sched.add(seq)
    step(sched)  # 4 blocks, one each; everyone's next token (position 4) needs a new block
    batch = sched.schedule()
    assert b not in batch.preempted
    assert batch.preempted[0] is a[2]


def test_no_thrash_a_tenant_over_its_share_does_not_take_room_an_under_share_one_could_not_use():
    sched = make_scheduler(num_blocks=4, max_num_seqs=4)
    a = [make_seq(f"a{i}", "a", prompt_len=2) for i in range(4)]
    for seq in a[:3]:
        sched.add(seq)
    step(sched)  # a0-a2 hold a block each
    b = make_seq("b0", "b", prompt_len=12)  # needs 3 blocks; 1 is free
    sched.add(b)
    sched.add(a[3])
    batch = step(sched)
    assert a[3] not in batch.seqs and b not in batch.seqs  # a is at its share (3); b's room stays free
    assert sched.block_manager.num_free_blocks == 1


def test_a_many_sample_request_runs_in_the_slots_its_share_allows():
    sched = make_scheduler(max_num_seqs=4)
    for i in range(4):
        sched.add(make_seq(f"a{i}", "a"))
    step(sched)
    b = make_seq("b0", "b", n=4)
    sched.add(b)
    batch = step(sched)
    assert len(batch.preempted) == 2  # b's share is 2 of the 4 slots
    assert [s.index for s in batch.samplers if s.request_id == "b0"] == [0, 1]
    assert [(s.request_id, s.index) for s in batch.deferred] == [("b0", 2), ("b0", 3)]
    assert running_by_tenant(sched) == {"a": 2, "b": 2}
    assert all(s.num_computed_tokens == 0 and not s.block_table for s in batch.deferred)


def test_aborting_many_waiting_sequences_of_one_tenant():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(f"a{i}", "a") for i in range(50)] + [make_seq("b0", "b")]
    for seq in seqs:
        sched.add(seq)
    step(sched)
    for seq in seqs[:50]:
        sched.finish(seq, "abort")
    assert sched.num_waiting == 0
    assert sched.tenant_load() == {"b": (1, 0)}
    assert all(s.finish_reason == "abort" for s in seqs[:50])
