"""The engine's counters (llmq/engine/counters.py) and the requests each step scheduled for the first
time (ScheduledBatch.started), exactly: prompt and generated tokens, prefix cache queries and hits in
tokens, preemptions.

As in test_scheduler.py, each step is `schedule()` then `postprocess()` with made-up token ids, block
size 4, values worked out by hand; the last test runs the real engine on stories260k.
"""
from __future__ import annotations

from llmq.engine.block_manager import BlockManager
from llmq.engine.config import EngineConfig
from llmq.engine.counters import EngineCounters
from llmq.engine.llm import LLMEngine
from llmq.engine.scheduler import Scheduler
from llmq.engine.sequence import Sequence
from llmq.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_scheduler(num_blocks=16, max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=True):
    return Scheduler(BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching), max_num_seqs, max_num_batched_tokens)


def make_seq(request_id, token_ids, n=1, **fields):
    return Sequence(request_id, list(token_ids), SamplingParams(n=n, max_tokens=100), **fields)


def step(sched):
    batch = sched.schedule()
    sched.postprocess(batch, [1000 + i for i in range(len(batch.samplers))])
    return batch


def counts(sched) -> dict[str, int]:
    return sched.counters.as_dict()


def test_prompt_tokens_count_once_when_the_first_token_is_made_and_every_sampled_token_is_generated():
    sched = make_scheduler(max_num_batched_tokens=10, enable_prefix_caching=False)
    a, b = make_seq("a", range(7)), make_seq("b", range(100, 106))
    sched.add(a)
    sched.add(b)
    batch = step(sched)  # a: all 7 prompt tokens, sampled; b: 3 of its 6, nothing sampled
    assert batch.started == [a, b]
    assert counts(sched) == {"prompt_tokens": 7, "generation_tokens": 1, "prefix_cache_queries": 0,
                             "prefix_cache_hits": 0, "num_preemptions": 0}
    batch = step(sched)  # a decodes, b finishes its prompt and samples
    assert batch.started == []
    assert (sched.counters.prompt_tokens, sched.counters.generation_tokens) == (7 + 6, 3)
    step(sched)
    assert (sched.counters.prompt_tokens, sched.counters.generation_tokens) == (13, 5)


def test_the_samples_of_one_prompt_count_its_tokens_once_and_generate_one_token_each():
    sched = make_scheduler(enable_prefix_caching=False)
    a = make_seq("a", range(5), n=3)
    sched.add(a)
    batch = step(sched)
    assert len(batch.samplers) == 3 and batch.started == [a]  # the forks are not new requests
    assert (sched.counters.prompt_tokens, sched.counters.generation_tokens) == (5, 3)
    step(sched)
    assert (sched.counters.prompt_tokens, sched.counters.generation_tokens) == (5, 6)


def test_prefix_cache_queries_and_hits_count_tokens_at_admission():
    sched = make_scheduler()
    a = make_seq("a", range(9))
    sched.add(a)
    step(sched)  # a's two full blocks (8 tokens) are cached
    assert (sched.counters.prefix_cache_queries, sched.counters.prefix_cache_hits) == (9, 0)
    b = make_seq("b", [*range(8), 50, 51])
    sched.add(b)
    batch = step(sched)
    assert batch.started == [b]
    assert b.num_cached_tokens == 8
    assert (sched.counters.prefix_cache_queries, sched.counters.prefix_cache_hits) == (9 + 10, 8)
    assert sched.counters.prompt_tokens == 9 + 10  # cached tokens are prompt tokens too, as vLLM counts them


def test_without_prefix_caching_nothing_is_queried():
    sched = make_scheduler(enable_prefix_caching=False)
    for name in ("a", "b"):
        sched.add(make_seq(name, range(9)))
    step(sched)
    step(sched)
    assert (sched.counters.prefix_cache_queries, sched.counters.prefix_cache_hits) == (0, 0)


def test_a_preempted_sequence_counts_a_preemption_and_neither_its_prompt_nor_its_start_again():
    sched = make_scheduler(num_blocks=4, enable_prefix_caching=False)
    a, b = make_seq("a", range(7)), make_seq("b", range(10, 17))
    sched.add(a)
    sched.add(b)
    assert step(sched).started == [a, b]
    step(sched)
    batch = step(sched)  # position 8 needs a block, none is free: b, the newest, gives way
    assert batch.preempted == [b]
    assert counts(sched) == {"prompt_tokens": 14, "generation_tokens": 2 + 2 + 1, "prefix_cache_queries": 0,
                             "prefix_cache_hits": 0, "num_preemptions": 1}
    sched.finish(a, "length")
    batch = step(sched)  # b again, its prompt and its two tokens recomputed
    assert batch.seqs == [b] and batch.num_new_tokens == [9] and batch.samplers == [b]
    assert batch.started == []
    assert counts(sched) == {"prompt_tokens": 14, "generation_tokens": 6, "prefix_cache_queries": 0,
                             "prefix_cache_hits": 0, "num_preemptions": 1}


def test_a_sample_deferred_for_want_of_a_slot_queries_the_cache_but_is_no_new_request():
    sched = make_scheduler(max_num_seqs=1)
    a = make_seq("a", range(5), n=2)
    sched.add(a)
    batch = step(sched)
    assert len(batch.deferred) == 1 and batch.started == [a]
    child = batch.deferred[0]
    sched.finish(a, "length")
    batch = step(sched)
    assert batch.seqs == [child] and batch.num_new_tokens == [1]  # its first block came from the cache
    assert batch.started == []
    assert counts(sched) == {"prompt_tokens": 5, "generation_tokens": 2, "prefix_cache_queries": 5 + 5,
                             "prefix_cache_hits": 4, "num_preemptions": 0}


def test_a_resumed_sequence_counts_only_the_tokens_it_makes_here():
    sched = make_scheduler(enable_prefix_caching=False)
    resumed = make_seq("r", [*range(5), 77, 78], num_prompt_tokens=5)  # two tokens made by another worker
    sched.add(resumed)
    assert step(sched).started == [resumed]
    assert (sched.counters.prompt_tokens, sched.counters.generation_tokens) == (0, 1)


def test_reset_and_as_dict():
    counters = EngineCounters(prompt_tokens=3, generation_tokens=4, prefix_cache_queries=5, prefix_cache_hits=1,
                              num_preemptions=2)
    assert counters.as_dict() == {"prompt_tokens": 3, "generation_tokens": 4, "prefix_cache_queries": 5,
                                  "prefix_cache_hits": 1, "num_preemptions": 2}
    counters.reset()
    assert counters == EngineCounters()


def test_the_engine_counts_what_its_requests_got(stories_dir):
    engine = LLMEngine(EngineConfig(str(stories_dir), dtype="float32", max_num_seqs=8))
    prompts = {"a": "Once upon a time", "b": "The cat sat on the mat", "c": "Once upon a time there"}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    seqs = {rid: engine.add_request(rid, prompt, params) for rid, prompt in prompts.items()}
    started, generated = [], 0
    while engine.has_unfinished():
        generated += sum(len(d.token_ids) for d in engine.step())
        started += engine.started
    assert sorted(started) == ["a", "b", "c"]
    assert engine.counters.generation_tokens == generated == 3 * 6
    assert engine.counters.prompt_tokens == sum(len(s.prompt_token_ids) for s in seqs.values())
    assert engine.counters.prefix_cache_queries == engine.counters.prompt_tokens  # each admitted once
    assert engine.counters.num_preemptions == 0
