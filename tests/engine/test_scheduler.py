"""Scheduler bookkeeping, exactly: who runs each step, how many tokens each computes, who samples,
which blocks they hold, who gets preempted.

No model: each step is simulated as `batch = schedule()` then `postprocess(batch, tokens)` with one
made-up token id per `batch.samplers`. Block size 4 throughout; expected values are worked out by hand.
"""

import pytest

from llmq.engine.block_manager import BlockManager
from llmq.engine.scheduler import ScheduledBatch, Scheduler
from llmq.engine.sequence import Sequence, SequenceStatus
from llmq.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_scheduler(num_blocks=16, max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=True):
    bm = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching)
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)


def make_seq(request_id, token_ids, n=1, priority=0):
    return Sequence(request_id, list(token_ids), SamplingParams(n=n, max_tokens=100), priority=priority)


def step(sched, sampled=None):
    """One simulated engine step. Sampled ids default to 1000, 1001, ... per sampler."""
    batch = sched.schedule()
    if sampled is None:
        sampled = [1000 + i for i in range(len(batch.samplers))]
    assert len(sampled) == len(batch.samplers)
    sched.postprocess(batch, sampled)
    return batch


# ---- token budget and chunked prefill --------------------------------------------------------


def test_token_budget_chunks_the_prefill_of_the_second_prompt():
    sched = make_scheduler(max_num_batched_tokens=10)
    a = make_seq("a", range(7))
    b = make_seq("b", range(100, 106))
    c = make_seq("c", range(200, 205))
    for s in (a, b, c):
        sched.add(s)

    batch = sched.schedule()
    assert batch.seqs == [a, b]
    assert batch.num_new_tokens == [7, 3]
    assert batch.num_tokens == 10
    assert batch.samplers == [a]  # b's chunk does not reach its last token
    assert batch.logits_rows == [0]
    assert batch.preempted == [] and batch.block_copies == []
    assert a.block_table == [0, 1] and b.block_table == [2]
    assert sched.waiting == [c]
    assert sched.postprocess(batch, [500]) == [a]
    assert a.token_ids == list(range(7)) + [500]
    assert (a.num_computed_tokens, a.num_tokens) == (7, 8)
    assert (b.num_computed_tokens, b.num_tokens) == (3, 6)

    # Running sequences first (a decodes 1, b finishes its prompt with 3), then c with what is left.
    batch = sched.schedule()
    assert batch.seqs == [a, b, c]
    assert batch.num_new_tokens == [1, 3, 5]
    assert batch.samplers == [a, b, c]
    assert batch.logits_rows == [0, 1, 2]
    assert a.block_table == [0, 1] and b.block_table == [2, 3] and c.block_table == [4, 5]
    sched.postprocess(batch, [501, 502, 503])
    assert (a.num_computed_tokens, a.num_tokens) == (8, 9)
    assert (b.num_computed_tokens, b.num_tokens) == (6, 7)
    assert (c.num_computed_tokens, c.num_tokens) == (5, 6)
    assert a.output_token_ids == [500, 501]
    assert b.output_token_ids == [502]
    assert c.output_token_ids == [503]

    batch = sched.schedule()
    assert batch.num_new_tokens == [1, 1, 1]
    assert batch.samplers == [a, b, c]


def test_long_prompt_is_prefilled_in_chunks_and_samples_only_at_the_end():
    sched = make_scheduler(max_num_batched_tokens=4)
    a = make_seq("a", range(10))
    sched.add(a)
    expected = [(4, [0], []), (4, [0, 1], []), (2, [0, 1, 2], [a])]
    for num_new, table, samplers in expected:
        batch = step(sched)
        assert batch.seqs == [a]
        assert batch.num_new_tokens == [num_new]
        assert a.block_table == table
        assert batch.samplers == samplers
    assert (a.num_computed_tokens, a.num_tokens) == (10, 11)
    assert a.output_token_ids == [1000]


def test_budget_spent_by_running_sequences_leaves_waiting_ones_waiting():
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_seq("a", range(8))
    sched.add(a)
    b = make_seq("b", range(100, 104))
    sched.add(b)
    batch = step(sched)
    assert batch.seqs == [a] and batch.num_new_tokens == [8]
    assert sched.waiting == [b]
    batch = step(sched)
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 4]


# ---- iteration-level batching ----------------------------------------------------------------


def test_finished_sequence_leaves_and_a_waiting_one_joins_next_step():
    sched = make_scheduler(max_num_seqs=2)
    a, b, c = make_seq("a", range(4)), make_seq("b", range(10, 14)), make_seq("c", range(20, 24))
    for s in (a, b, c):
        sched.add(s)

    batch = step(sched)
    assert batch.seqs == [a, b]  # max_num_seqs = 2
    assert sched.running == [a, b]
    assert sched.waiting == [c]
    assert c.status is SequenceStatus.WAITING and c.block_table == []

    sched.finish(a, "stop", 1000)
    assert a.status is SequenceStatus.FINISHED
    assert (a.finish_reason, a.stop_reason) == ("stop", 1000)
    assert sched.running == [b]
    assert a.block_table == []

    batch = step(sched)
    assert batch.seqs == [b, c]
    assert batch.num_new_tokens == [1, 4]
    assert sched.running == [b, c]
    assert sched.waiting == []
    # a's block 0 was full, so it was hashed and queued behind the never-used blocks.
    assert b.block_table == [1, 2]
    assert c.block_table == [3]


def test_max_num_seqs_holds_until_a_slot_frees():
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_seq("a", range(4)), make_seq("b", range(10, 14))
    sched.add(a)
    sched.add(b)
    for _ in range(3):
        batch = step(sched)
        assert batch.seqs == [a]
        assert sched.waiting == [b]
    sched.finish(a, "length")
    batch = step(sched)
    assert batch.seqs == [b]
    assert batch.num_new_tokens == [4]


def test_empty_scheduler_gives_an_empty_batch():
    sched = make_scheduler()
    batch = sched.schedule()
    assert not batch
    assert batch == ScheduledBatch()
    assert sched.postprocess(batch, []) == []
    assert sched.has_unfinished() is False


# ---- priority --------------------------------------------------------------------------------


def test_lower_priority_value_is_admitted_first_fcfs_among_equals():
    sched = make_scheduler(max_num_seqs=2)
    seqs = {name: make_seq(name, range(i * 10, i * 10 + 4), priority=prio)
            for i, (name, prio) in enumerate([("a", 1), ("b", 0), ("c", 1), ("d", 0), ("e", 2)])}
    for s in seqs.values():
        sched.add(s)
    assert [s.request_id for s in sched.waiting] == ["b", "d", "a", "c", "e"]
    admitted = []
    while sched.has_unfinished():
        batch = step(sched)
        admitted.append([s.request_id for s in batch.seqs])
        for s in list(batch.seqs):
            sched.finish(s, "stop")
    assert admitted == [["b", "d"], ["a", "c"], ["e"]]


def test_late_high_priority_request_overtakes_earlier_waiting_ones():
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_seq("a", range(4), priority=3), make_seq("b", range(10, 14), priority=3)
    sched.add(a)
    sched.add(b)
    assert step(sched).seqs == [a]
    urgent = make_seq("urgent", range(20, 24), priority=0)
    sched.add(urgent)
    sched.finish(a, "stop")
    assert step(sched).seqs == [urgent]
    sched.finish(urgent, "stop")
    assert step(sched).seqs == [b]


# ---- preemption ------------------------------------------------------------------------------


def test_out_of_blocks_preempts_the_newest_running_sequence():
    sched = make_scheduler(num_blocks=6, enable_prefix_caching=False)
    a, b, c = make_seq("a", range(7)), make_seq("b", range(10, 17)), make_seq("c", range(20, 27))
    for s in (a, b, c):
        sched.add(s)
    batch = step(sched)
    assert batch.num_new_tokens == [7, 7, 7]
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1], [2, 3], [4, 5])
    batch = step(sched)  # position 7 fits in each last block
    assert batch.num_new_tokens == [1, 1, 1]
    assert sched.block_manager.num_free_blocks == 0

    batch = sched.schedule()  # position 8: a needs a block, none free
    assert batch.preempted == [c]
    assert batch.seqs == [a, b]
    assert batch.num_new_tokens == [1, 1]
    assert a.block_table == [0, 1, 4]
    assert b.block_table == [2, 3, 5]
    assert c.block_table == []
    assert c.status is SequenceStatus.WAITING
    assert c.num_computed_tokens == 0
    assert c.num_preemptions == 1
    assert (a.num_preemptions, b.num_preemptions) == (0, 0)
    assert sched.running == [a, b]
    assert sched.waiting == [c]
    assert sched.block_manager.ref_counts == [1, 1, 1, 1, 1, 1]


def test_preempted_sequence_is_recomputed_with_its_generated_tokens():
    sched = make_scheduler(num_blocks=4, enable_prefix_caching=False)
    bm = sched.block_manager
    a, b = make_seq("a", range(7)), make_seq("b", range(10, 17))
    sched.add(a)
    sched.add(b)
    step(sched, [100, 200])
    step(sched, [101, 201])
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    assert bm.num_free_blocks == 0

    batch = sched.schedule()
    assert batch.preempted == [b]
    assert batch.seqs == [a]
    assert batch.samplers == [a]
    assert a.block_table == [0, 1, 2]
    assert b.block_table == []
    assert (b.num_computed_tokens, b.num_preemptions, b.status) == (0, 1, SequenceStatus.WAITING)
    assert b.token_ids == list(range(10, 17)) + [200, 201]  # generated tokens are kept
    assert bm.num_free_blocks == 1
    assert bm.ref_counts == [1, 1, 1, 0]
    sched.postprocess(batch, [102])

    # b needs 3 blocks, 1 is free: it keeps waiting; no exception, a runs on.
    batch = step(sched, [103])
    assert batch.seqs == [a] and batch.preempted == []
    assert sched.waiting == [b]

    sched.finish(a, "length")
    assert bm.num_free_blocks == 4
    batch = sched.schedule()
    assert batch.seqs == [b]
    assert batch.num_new_tokens == [9]  # prompt 7 + generated 2, all recomputed
    assert batch.samplers == [b]
    assert b.block_table == [0, 1, 2]
    sched.postprocess(batch, [202])
    assert b.output_token_ids == [200, 201, 202]
    assert (b.num_computed_tokens, b.num_tokens) == (9, 10)


def test_preempted_sequence_recomputes_in_chunks_under_the_token_budget():
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=6, enable_prefix_caching=False)
    a, b = make_seq("a", range(7)), make_seq("b", range(10, 17))
    sched.add(a)
    sched.add(b)
    batch = step(sched)
    assert batch.seqs == [a] and batch.num_new_tokens == [6] and batch.samplers == []
    batch = step(sched)
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 5] and batch.samplers == [a]
    batch = step(sched)
    assert batch.num_new_tokens == [1, 2] and batch.samplers == [a, b]
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    batch = step(sched)  # a's position 8 needs a block
    assert batch.preempted == [b] and batch.seqs == [a]
    assert a.block_table == [0, 1, 2]
    assert b.num_tokens == 8
    sched.finish(a, "stop")
    batch = step(sched)
    assert batch.seqs == [b] and batch.num_new_tokens == [6] and batch.samplers == []
    batch = step(sched)
    assert batch.seqs == [b] and batch.num_new_tokens == [2] and batch.samplers == [b]
    assert b.token_ids == list(range(10, 17)) + [1001, 1000]


def test_readmitted_sequence_reuses_its_own_cached_blocks():
    sched = make_scheduler(num_blocks=4, enable_prefix_caching=True)
    bm = sched.block_manager
    a, b = make_seq("a", range(7)), make_seq("b", range(10, 17))
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    batch = step(sched)
    assert batch.preempted == [b]
    # b's hashed blocks went to the back of the free list tail-first; a took 3 (b's second block).
    assert a.block_table == [0, 1, 3]
    assert bm.find_cached_prefix(b) == [2]
    step(sched)  # b hits block 2 but still needs 2 more blocks with only block 2 free
    assert sched.waiting == [b]
    sched.finish(a, "stop")
    batch = sched.schedule()
    assert batch.seqs == [b]
    assert b.num_cached_tokens == 4
    assert b.num_computed_tokens == 4
    assert batch.num_new_tokens == [5]
    assert b.block_table == [2, 3, 1]
    assert batch.samplers == [b]


def test_sequence_preempts_itself_when_it_is_the_only_one_left():
    sched = make_scheduler(num_blocks=2, enable_prefix_caching=False)
    a = make_seq("a", range(8))
    sched.add(a)
    step(sched)
    assert a.block_table == [0, 1]
    batch = sched.schedule()  # position 8 needs a third block
    assert batch.seqs == [] and batch.preempted == [a]
    assert not batch
    assert (a.status, a.num_preemptions, a.num_computed_tokens) == (SequenceStatus.WAITING, 1, 0)
    assert sched.block_manager.num_free_blocks == 2


def test_preemption_picks_the_lowest_priority_running_sequence():
    """A (priority 5) runs first; B (priority 0) arrives and is admitted later. When A needs a block
    and none is free, A (the lowest priority) must give way, not B."""
    sched = make_scheduler(num_blocks=2, enable_prefix_caching=False)
    a = make_seq("a", range(3), priority=5)
    sched.add(a)
    step(sched)
    b = make_seq("b", range(10, 13), priority=0)
    sched.add(b)
    batch = step(sched)
    assert batch.seqs == [a, b]
    assert (a.block_table, b.block_table) == ([0], [1])
    batch = sched.schedule()  # a's position 4 needs a block; b's position 3 fits in block 1
    assert [s.request_id for s in batch.preempted] == ["a"]
    assert [s.request_id for s in batch.seqs] == ["b"]
    assert b.num_preemptions == 0
    assert b.block_table == [1]


def test_no_admission_in_a_step_that_preempted():
    sched = make_scheduler(num_blocks=4, enable_prefix_caching=False)
    a, b = make_seq("a", range(7)), make_seq("b", range(10, 17))
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    small = make_seq("small", [50], priority=-1)
    sched.add(small)
    batch = sched.schedule()
    assert batch.preempted == [b]
    assert batch.seqs == [a]  # one block is free, yet nothing is admitted this step
    assert sched.waiting == [small, b]


# ---- n > 1 -----------------------------------------------------------------------------------


def test_n_samples_fork_when_the_prompt_completes_and_share_blocks():
    sched = make_scheduler()
    bm = sched.block_manager
    parent = make_seq("r", range(6), n=3)
    sched.add(parent)
    assert parent.forks_pending == 2

    batch = sched.schedule()
    assert batch.seqs == [parent]
    assert batch.num_new_tokens == [6]
    assert len(batch.samplers) == 3
    assert batch.samplers[0] is parent
    c1, c2 = batch.samplers[1:]
    assert [s.index for s in batch.samplers] == [0, 1, 2]
    assert {s.request_id for s in batch.samplers} == {"r"}
    assert batch.logits_rows == [0, 0, 0]
    assert parent.forks_pending == 0
    assert sched.running == [parent, c1, c2]
    assert parent.block_table == c1.block_table == c2.block_table == [0, 1]
    assert bm.ref_counts[:3] == [3, 3, 0]
    assert bm.num_blocks - bm.num_free_blocks == 2
    assert (c1.num_computed_tokens, c2.num_computed_tokens) == (6, 6)

    sched.postprocess(batch, [10, 11, 12])
    assert parent.token_ids == list(range(6)) + [10]
    assert c1.token_ids == list(range(6)) + [11]
    assert c2.token_ids == list(range(6)) + [12]
    assert parent.num_computed_tokens == c1.num_computed_tokens == c2.num_computed_tokens == 6

    # Each writes position 6 into shared partial block 1: the first two copy it, the last owner writes in place.
    batch = sched.schedule()
    assert batch.seqs == [parent, c1, c2]
    assert batch.num_new_tokens == [1, 1, 1]
    assert batch.logits_rows == [0, 1, 2]
    assert batch.block_copies == [(1, 2), (1, 3)]
    assert (parent.block_table, c1.block_table, c2.block_table) == ([0, 2], [0, 3], [0, 1])
    assert bm.ref_counts[:5] == [3, 1, 1, 1, 0]
    assert bm.pending_copies == []


def test_n_samples_use_fewer_blocks_than_separate_requests():
    forked = make_scheduler()
    forked.add(make_seq("r", range(6), n=3))
    step(forked)
    used_forked = forked.block_manager.num_blocks - forked.block_manager.num_free_blocks

    for caching, expected in ((True, 4), (False, 6)):
        separate = make_scheduler(enable_prefix_caching=caching)
        for i in range(3):
            separate.add(make_seq(f"s{i}", range(6)))
        step(separate)
        used_separate = separate.block_manager.num_blocks - separate.block_manager.num_free_blocks
        assert used_separate == expected
        assert used_forked == 2 < used_separate


def test_n_samples_fork_after_a_chunked_prefill():
    sched = make_scheduler(max_num_batched_tokens=4)
    parent = make_seq("r", range(6), n=2)
    sched.add(parent)
    batch = step(sched)
    assert batch.num_new_tokens == [4] and batch.samplers == []
    assert sched.running == [parent]
    batch = step(sched)
    assert batch.num_new_tokens == [2]
    assert len(batch.samplers) == 2 and batch.logits_rows == [0, 0]
    child = batch.samplers[1]
    assert child.index == 1 and child.block_table == [0, 1]
    assert sched.block_manager.ref_counts[:2] == [2, 2]


def test_n_samples_beyond_max_num_seqs_wait_for_a_slot_with_the_prompt_alone():
    sched = make_scheduler(max_num_seqs=3)
    a = make_seq("a", range(4))
    r = make_seq("r", range(10, 19), n=3)
    sched.add(a)
    sched.add(r)
    batch = step(sched)
    assert batch.seqs == [a, r]  # r and one fork run; its third sample waits
    assert [s.index for s in batch.samplers] == [0, 0, 1]
    (waiter,) = batch.deferred
    assert waiter.index == 2 and waiter.token_ids == list(range(10, 19))
    assert sched.waiting == [waiter]
    sched.finish(a, "stop")
    batch = step(sched)
    assert waiter in batch.seqs
    assert waiter.num_cached_tokens == 8  # the prompt's two full blocks, from the prefix cache
    assert batch.num_new_tokens[batch.seqs.index(waiter)] == 1
    assert len(sched.running) == 3


# ---- finish ----------------------------------------------------------------------------------


def test_finish_frees_every_block_and_is_idempotent():
    sched = make_scheduler()
    bm = sched.block_manager
    a, b = make_seq("a", range(9)), make_seq("b", range(20, 26))
    sched.add(a)
    sched.add(b)
    step(sched)
    assert bm.num_free_blocks == 16 - 5
    sched.finish(a, "stop", "###")
    assert bm.num_free_blocks == 16 - 2
    sched.finish(a, "abort")  # no-op: reason kept, blocks not freed twice
    assert (a.finish_reason, a.stop_reason) == ("stop", "###")
    assert bm.num_free_blocks == 16 - 2
    sched.finish(b, "length")
    assert bm.num_free_blocks == 16
    assert bm.ref_counts == [0] * 16
    assert sched.running == [] and sched.waiting == []
    assert sched.has_unfinished() is False
    assert not sched.schedule()


def test_finish_twice_does_not_release_blocks_shared_with_siblings():
    sched = make_scheduler()
    bm = sched.block_manager
    parent = make_seq("r", range(6), n=3)
    sched.add(parent)
    batch = step(sched)
    _, c1, c2 = batch.samplers
    sched.finish(c1, "stop")
    sched.finish(c1, "stop")
    assert bm.ref_counts[:2] == [2, 2]
    assert sched.running == [parent, c2]
    sched.finish(parent, "stop")
    sched.finish(c2, "length")
    assert bm.num_free_blocks == 16
    assert bm.ref_counts == [0] * 16


def test_finish_a_waiting_sequence():
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_seq("a", range(4)), make_seq("b", range(10, 14))
    sched.add(a)
    sched.add(b)
    step(sched)
    sched.finish(b, "abort")
    assert sched.waiting == []
    assert b.status is SequenceStatus.FINISHED and b.finish_reason == "abort"
    assert sched.block_manager.num_free_blocks == 15
    assert step(sched).seqs == [a]


@pytest.mark.parametrize("num_seqs", [1, 3, 7])
def test_run_to_completion_returns_every_block(num_seqs):
    """Many steps with a tight pool and budget: preemptions happen, nothing leaks, all finish."""
    sched = make_scheduler(num_blocks=6, max_num_seqs=4, max_num_batched_tokens=6)
    bm = sched.block_manager
    seqs = [make_seq(f"s{i}", range(i * 100, i * 100 + 5 + i)) for i in range(num_seqs)]
    for s in seqs:
        sched.add(s)
    for _ in range(500):
        if not sched.has_unfinished():
            break
        batch = step(sched)
        for s in batch.samplers:
            if s.num_output_tokens >= 6:
                sched.finish(s, "length")
        live_refs = sum(len(s.block_table) for s in sched.running)
        assert sum(bm.ref_counts) == live_refs
        assert bm.num_free_blocks == sum(1 for r in bm.ref_counts if r == 0)
    assert not sched.has_unfinished()
    assert all(s.num_output_tokens == 6 for s in seqs)
    assert bm.num_free_blocks == 6
