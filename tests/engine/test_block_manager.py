"""BlockManager bookkeeping, exactly: block ids, reference counts, free counts, copy-on-write pairs.

Plain Python on integers (no torch, no model). Every expected value below is worked out by hand from
the documented policy: the free list starts as 0, 1, 2, ...; a freed unhashed block goes to the
front; a freed hashed block goes to the back (tail of a sequence before its head); a prefix hit never
covers the block that holds the sequence's last token.
"""

from llmq.engine.block_manager import BlockManager
from llmq.engine.sequence import Sequence
from llmq.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 8


def make_seq(token_ids, request_id="r"):
    return Sequence(request_id, list(token_ids), SamplingParams())


def manager(num_blocks=NUM_BLOCKS, enable_prefix_caching=True):
    return BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching)


def admit(bm, seq):
    """What the scheduler does on admission: take the prefix hits, allocate the rest, mark it computed."""
    cached = bm.find_cached_prefix(seq)
    num_cached = len(cached) * BLOCK_SIZE
    assert bm.allocate_slots(seq, seq.num_tokens - num_cached, cached)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq, seq.num_tokens)
    return cached


def free_order(bm):
    """The free list, front (reused first) to back, without changing anything."""
    return list(bm._free)


# ---- allocation ------------------------------------------------------------------------------


def test_new_manager_is_all_free():
    bm = manager()
    assert bm.num_free_blocks == 8
    assert bm.ref_counts == [0] * 8
    assert free_order(bm) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert bm.pending_copies == []


def test_blocks_needed_rounds_up():
    bm = manager()
    assert [bm.blocks_needed(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


def test_allocation_takes_blocks_in_free_list_order():
    bm = manager()
    a = make_seq(range(6))  # 6 tokens -> 2 blocks
    b = make_seq(range(100, 109))  # 9 tokens -> 3 blocks
    assert bm.allocate_slots(a, 6) is True
    assert a.block_table == [0, 1]
    assert bm.allocate_slots(b, 9) is True
    assert b.block_table == [2, 3, 4]
    assert bm.ref_counts == [1, 1, 1, 1, 1, 0, 0, 0]
    assert bm.num_free_blocks == 3


def test_allocation_grows_only_when_a_block_fills():
    bm = manager()
    seq = make_seq(range(3))
    assert bm.allocate_slots(seq, 3)
    assert seq.block_table == [0]
    seq.num_computed_tokens = 3
    seq.token_ids.append(50)  # position 3: still block 0
    assert bm.allocate_slots(seq, 1)
    assert seq.block_table == [0]
    assert bm.num_free_blocks == 7
    seq.num_computed_tokens = 4
    seq.token_ids.append(51)  # position 4: needs block 1
    assert bm.allocate_slots(seq, 1)
    assert seq.block_table == [0, 1]
    assert bm.ref_counts[:3] == [1, 1, 0]
    assert bm.num_free_blocks == 6


def test_allocate_slots_is_all_or_nothing_for_a_new_sequence():
    bm = manager()
    big = make_seq(range(24))  # 6 blocks
    assert bm.allocate_slots(big, 24)
    assert bm.num_free_blocks == 2
    other = make_seq(range(100, 112))  # 12 tokens -> 3 blocks, only 2 free
    assert bm.allocate_slots(other, 12) is False
    assert other.block_table == []
    assert bm.num_free_blocks == 2
    assert bm.ref_counts == [1, 1, 1, 1, 1, 1, 0, 0]
    assert free_order(bm) == [6, 7]
    # Exactly as many as are free still fits.
    assert bm.allocate_slots(other, 8) is True
    assert other.block_table == [6, 7]
    assert bm.num_free_blocks == 0


def test_allocate_slots_is_all_or_nothing_for_a_growing_sequence():
    bm = manager()
    filler = make_seq(range(20))  # 5 blocks
    assert bm.allocate_slots(filler, 20)
    seq = make_seq(range(100, 104))
    assert bm.allocate_slots(seq, 4)
    assert seq.block_table == [5]
    seq.num_computed_tokens = 4
    seq.token_ids.extend(range(200, 209))  # 9 more tokens -> 3 more blocks, 2 free
    assert bm.allocate_slots(seq, 9) is False
    assert seq.block_table == [5]
    assert bm.ref_counts == [1, 1, 1, 1, 1, 1, 0, 0]
    assert bm.num_free_blocks == 2
    assert bm.allocate_slots(seq, 8) is True
    assert seq.block_table == [5, 6, 7]


def test_allocate_slots_counts_reclaimed_cached_blocks_against_the_free_ones():
    bm = manager()
    prompt = list(range(9))
    a = make_seq(prompt)
    admit(bm, a)  # blocks 0, 1 (hashed), 2
    filler = make_seq(range(100, 120))  # 5 blocks: 3..7
    assert bm.allocate_slots(filler, 20)
    bm.free(a)  # free list: 2 (unhashed, front), then 1, 0 (hashed, tail first)
    assert free_order(bm) == [2, 1, 0]
    b = make_seq(prompt + list(range(300, 307)))  # 16 tokens: hits blocks 0, 1; needs 2 more, 1 left
    cached = bm.find_cached_prefix(b)
    assert cached == [0, 1]
    assert bm.allocate_slots(b, b.num_tokens - 8, cached) is False
    assert b.block_table == []
    assert bm.ref_counts == [0, 0, 0, 1, 1, 1, 1, 1]
    assert free_order(bm) == [2, 1, 0]
    assert bm.cached_blocks == {a.block_hashes[0]: 0, a.block_hashes[1]: 1}
    # One new block fits: 8 cached + 4 new tokens.
    c = make_seq(prompt + list(range(300, 303)))
    assert bm.allocate_slots(c, 4, bm.find_cached_prefix(c)) is True
    assert c.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 0


# ---- free and reuse order --------------------------------------------------------------------


def test_free_returns_blocks_and_zeroes_refcounts():
    bm = manager()
    a, b = make_seq(range(8)), make_seq(range(100, 105))
    assert bm.allocate_slots(a, 8) and bm.allocate_slots(b, 5)
    assert bm.num_free_blocks == 4
    bm.free(a)
    assert a.block_table == []
    assert bm.ref_counts == [0, 0, 1, 1, 0, 0, 0, 0]
    assert bm.num_free_blocks == 6
    bm.free(b)
    assert bm.num_free_blocks == 8
    assert bm.ref_counts == [0] * 8


def test_freed_unhashed_blocks_are_reused_first():
    bm = manager(enable_prefix_caching=False)
    a, b = make_seq(range(4)), make_seq(range(4, 8))
    assert bm.allocate_slots(a, 4) and bm.allocate_slots(b, 4)
    assert (a.block_table, b.block_table) == ([0], [1])
    bm.free(a)
    assert free_order(bm) == [0, 2, 3, 4, 5, 6, 7]
    c = make_seq(range(20, 24))
    assert bm.allocate_slots(c, 4)
    assert c.block_table == [0]


def test_free_order_unhashed_first_then_never_used_then_hashed_tail_before_head():
    bm = manager()
    a = make_seq(range(9))
    admit(bm, a)
    assert a.block_table == [0, 1, 2]
    assert bm.block_hash[0] is not None and bm.block_hash[1] is not None and bm.block_hash[2] is None
    bm.free(a)
    assert free_order(bm) == [2, 3, 4, 5, 6, 7, 1, 0]
    # Reuse follows that order exactly, evicting the cached blocks last.
    big = make_seq(range(100, 132))
    assert bm.allocate_slots(big, 32)
    assert big.block_table == [2, 3, 4, 5, 6, 7, 1, 0]
    assert bm.cached_blocks == {}
    assert bm.block_hash == [None] * 8


def test_hashed_tail_is_evicted_before_head():
    bm = manager()
    a = make_seq(range(12))
    admit(bm, a)  # blocks 0, 1, 2 all full and hashed
    bm.free(a)
    assert free_order(bm) == [3, 4, 5, 6, 7, 2, 1, 0]
    filler = make_seq(range(100, 124))  # 6 blocks: 3..7 and 2 (evicts a's third block)
    assert bm.allocate_slots(filler, 24)
    assert filler.block_table == [3, 4, 5, 6, 7, 2]
    again = make_seq(range(13))  # a's 12 tokens + 1: could hit 3 blocks, block 2 was evicted
    assert bm.find_cached_prefix(again) == [0, 1]


# ---- prefix caching --------------------------------------------------------------------------


def test_prefix_hit_returns_the_same_block_ids_and_shares_them():
    bm = manager()
    prompt = list(range(9))
    a = make_seq(prompt)
    assert admit(bm, a) == []
    assert a.block_table == [0, 1, 2]
    b = make_seq(prompt)
    cached = bm.find_cached_prefix(b)
    assert cached == [0, 1]
    assert bm.allocate_slots(b, 1, cached)
    assert b.block_table == [0, 1, 3]
    assert bm.ref_counts == [2, 2, 1, 1, 0, 0, 0, 0]
    assert bm.num_free_blocks == 4


def test_prefix_hit_never_covers_the_last_token():
    bm = manager()
    a = make_seq(range(8))  # exactly 2 full blocks
    admit(bm, a)
    assert set(bm.cached_blocks.values()) == {0, 1}
    same = make_seq(range(8))
    assert bm.find_cached_prefix(same) == [0]  # block 1 holds the last token: it must be computed
    longer = make_seq(range(9))
    assert bm.find_cached_prefix(longer) == [0, 1]
    one_block = make_seq(range(4))
    assert bm.find_cached_prefix(one_block) == []
    single = make_seq([0])
    assert bm.find_cached_prefix(single) == []


def test_only_full_blocks_are_cached():
    bm = manager()
    a = make_seq(range(7))  # one full block, one partial
    admit(bm, a)
    assert bm.cached_blocks == {a.block_hashes[0]: 0}
    assert bm.block_hash[1] is None
    b = make_seq(list(range(7)) + [99, 100])  # same 7 tokens: only block 0 can hit
    assert bm.find_cached_prefix(b) == [0]


def test_partial_cache_publishing_follows_num_computed_tokens():
    bm = manager()
    a = make_seq(range(12))
    assert bm.allocate_slots(a, 12)
    bm.cache_full_blocks(a, 5)  # a chunk of 5 computed: one full block
    assert bm.cached_blocks == {a.block_hashes[0]: 0}
    bm.cache_full_blocks(a, 12)
    assert set(bm.cached_blocks.values()) == {0, 1, 2}


def test_each_block_is_offered_once_as_it_fills():
    bm = manager()
    a = make_seq(range(6))
    assert bm.allocate_slots(a, 6)
    bm.cache_full_blocks(a, 6)
    assert a.num_offered_blocks == 1 and bm.cached_blocks == {a.block_hashes[0]: 0}
    bm.cache_full_blocks(a, 6)  # nothing new filled: nothing offered
    assert a.num_offered_blocks == 1
    a.token_ids.extend([6, 7])
    assert bm.allocate_slots(a, 2)
    bm.cache_full_blocks(a, 8)
    assert a.num_offered_blocks == 2 and bm.cached_blocks == {a.block_hashes[0]: 0, a.block_hashes[1]: 1}
    # Another sequence with the same tokens keeps its own copies unpublished: one block per hash.
    b = make_seq(range(8), request_id="b")
    assert bm.allocate_slots(b, 8)
    bm.cache_full_blocks(b, 8)
    assert b.num_offered_blocks == 2 and b.block_table == [2, 3]
    assert bm.block_hash[2] is None and bm.block_hash[3] is None


def test_a_freed_sequence_offers_its_blocks_again_when_recomputed():
    """A preempted sequence loses its blocks; recomputed into new ones, it publishes those."""
    bm = manager()
    a = make_seq(range(8))
    admit(bm, a)
    assert a.num_offered_blocks == 2
    bm.free(a)
    assert a.num_offered_blocks == 0
    filler = make_seq(range(100, 132), request_id="filler")  # takes all 8 blocks: evicts a's
    assert bm.allocate_slots(filler, 32)
    bm.free(filler)
    assert bm.cached_blocks == {}
    a.num_computed_tokens = 0
    assert bm.find_cached_prefix(a) == []
    assert bm.allocate_slots(a, 8)
    bm.cache_full_blocks(a, 8)
    assert set(bm.cached_blocks.values()) == set(a.block_table) and len(a.block_table) == 2


def test_a_forked_sample_offers_only_the_blocks_it_fills_after_the_fork():
    bm = manager()
    parent = make_seq(range(6))
    admit(bm, parent)  # block 0 published, block 1 partial
    child = parent.fork(1)
    bm.fork(parent, child)
    assert child.num_offered_blocks == 1
    child.token_ids.extend([76, 77])  # positions 6, 7 fill the child's copy of block 1
    assert bm.allocate_slots(child, 2)
    child.num_computed_tokens = 8
    bm.cache_full_blocks(child, 8)
    assert child.block_table == [0, 2] and bm.block_hash[2] == child.block_hashes[1]
    assert child.num_offered_blocks == 2


def test_a_difference_in_block_zero_breaks_every_later_hit():
    bm = manager()
    prompt = list(range(13))
    admit(bm, make_seq(prompt))  # blocks 0, 1, 2 hashed
    changed_first = make_seq([999] + prompt[1:])  # blocks 1 and 2 have equal tokens, chain differs
    assert bm.find_cached_prefix(changed_first) == []
    changed_second = make_seq(prompt[:5] + [999] + prompt[6:])
    assert bm.find_cached_prefix(changed_second) == [0]
    changed_third = make_seq(prompt[:8] + [999] + prompt[9:])
    assert bm.find_cached_prefix(changed_third) == [0, 1]
    unchanged = make_seq(prompt)
    assert bm.find_cached_prefix(unchanged) == [0, 1, 2]


def test_equal_block_after_a_different_prefix_is_a_different_cache_entry():
    """Block 1 of `a` and of `b` hold the same tokens, but their KV differs (different block 0):
    a query shaped like `b` must hit b's own block 1, never a's."""
    bm = manager()
    shared_tail = [50, 51, 52, 53]
    a = make_seq([0, 1, 2, 3] + shared_tail + [9])
    admit(bm, a)  # blocks 0, 1 hashed, 2 partial
    b = make_seq([10, 11, 12, 13] + shared_tail + [9])
    assert bm.find_cached_prefix(b) == []
    admit(bm, b)  # blocks 3, 4 hashed, 5 partial
    assert b.block_table == [3, 4, 5]
    assert b.block_hashes[1] != a.block_hashes[1]
    assert len(bm.cached_blocks) == 4
    query = make_seq([10, 11, 12, 13] + shared_tail + [7, 7])
    assert bm.find_cached_prefix(query) == [3, 4]


def test_freed_cached_blocks_can_be_hit_until_evicted():
    bm = manager()
    prompt = list(range(9))
    a = make_seq(prompt)
    admit(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 8
    assert bm.ref_counts == [0] * 8
    # A hit takes the freed cached blocks back out of the free list.
    b = make_seq(prompt)
    cached = bm.find_cached_prefix(b)
    assert cached == [0, 1]
    assert bm.allocate_slots(b, 1, cached)
    assert b.block_table == [0, 1, 2]
    assert bm.ref_counts == [1, 1, 1, 0, 0, 0, 0, 0]
    assert bm.num_free_blocks == 5
    bm.free(b)
    assert free_order(bm) == [2, 3, 4, 5, 6, 7, 1, 0]
    # Reuse of 7 blocks evicts block 1 (the tail) but not block 0.
    filler = make_seq(range(100, 128))
    assert bm.allocate_slots(filler, 28)
    assert filler.block_table == [2, 3, 4, 5, 6, 7, 1]
    assert bm.find_cached_prefix(make_seq(prompt)) == [0]
    bm.free(filler)
    # Now evict block 0 as well.
    filler2 = make_seq(range(200, 232))
    assert bm.allocate_slots(filler2, 32)
    assert 0 in filler2.block_table
    assert bm.find_cached_prefix(make_seq(prompt)) == []
    assert bm.cached_blocks == {}


def test_no_hits_when_prefix_caching_is_disabled():
    bm = manager(enable_prefix_caching=False)
    prompt = list(range(13))
    a = make_seq(prompt)
    assert admit(bm, a) == []
    assert bm.cached_blocks == {}
    assert bm.block_hash == [None] * 8
    assert bm.find_cached_prefix(make_seq(prompt)) == []
    bm.free(a)
    assert bm.find_cached_prefix(make_seq(prompt)) == []
    b = make_seq(prompt)
    assert admit(bm, b) == []
    assert b.block_table == [0, 1, 2, 3]


# ---- fork and copy-on-write ------------------------------------------------------------------


def test_fork_shares_every_block():
    bm = manager()
    parent = make_seq(range(6))  # block 0 full, block 1 partial
    admit(bm, parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    assert child.block_table == [0, 1]
    assert child.block_table is not parent.block_table
    assert bm.ref_counts[:3] == [2, 2, 0]
    assert bm.num_free_blocks == 6


def test_first_write_into_a_shared_partial_block_copies_it():
    bm = manager()
    parent = make_seq(range(6))
    admit(bm, parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    child.token_ids.append(77)  # position 6, inside shared block 1
    assert bm.allocate_slots(child, 1)
    assert child.block_table == [0, 2]
    assert parent.block_table == [0, 1]
    assert bm.pending_copies == [(1, 2)]
    assert bm.ref_counts[:3] == [2, 1, 1]
    assert bm.num_free_blocks == 5
    # The parent is now the only owner of block 1: it writes in place, no copy.
    parent.token_ids.append(88)
    assert bm.allocate_slots(parent, 1)
    assert parent.block_table == [0, 1]
    assert bm.pending_copies == [(1, 2)]
    assert bm.take_pending_copies() == [(1, 2)]
    assert bm.pending_copies == []
    assert bm.take_pending_copies() == []


def test_shared_full_blocks_are_never_copied():
    bm = manager()
    parent = make_seq(range(8))  # two full blocks
    admit(bm, parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    child.token_ids.append(77)  # position 8: a new block
    assert bm.allocate_slots(child, 1)
    parent.token_ids.append(88)
    assert bm.allocate_slots(parent, 1)
    assert child.block_table == [0, 1, 2]
    assert parent.block_table == [0, 1, 3]
    assert bm.pending_copies == []
    assert bm.ref_counts[:4] == [2, 2, 1, 1]


def test_copy_on_write_is_all_or_nothing():
    bm = manager(num_blocks=3)
    parent = make_seq(range(6))
    admit(bm, parent)  # blocks 0, 1
    child = parent.fork(1)
    bm.fork(parent, child)
    child.token_ids.extend([70, 71, 72])  # positions 6..8: a copy of block 1 and a new block, 1 free
    assert bm.allocate_slots(child, 3) is False
    assert child.block_table == [0, 1]
    assert bm.ref_counts == [2, 2, 0]
    assert bm.pending_copies == []
    assert bm.num_free_blocks == 1
    assert bm.allocate_slots(child, 2) is True  # positions 6, 7: just the copy
    assert child.block_table == [0, 2]
    assert bm.pending_copies == [(1, 2)]
    assert bm.ref_counts == [2, 1, 1]


def test_freeing_forked_sequences_returns_shared_blocks_only_when_the_last_owner_goes():
    bm = manager()
    parent = make_seq(range(6))
    admit(bm, parent)
    children = [parent.fork(i) for i in (1, 2)]
    for child in children:
        bm.fork(parent, child)
    assert bm.ref_counts[:2] == [3, 3]
    bm.free(parent)
    assert bm.ref_counts[:2] == [2, 2]
    assert bm.num_free_blocks == 6
    bm.free(children[0])
    assert bm.num_free_blocks == 6
    bm.free(children[1])
    assert bm.ref_counts == [0] * 8
    assert bm.num_free_blocks == 8
