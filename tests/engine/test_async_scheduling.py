"""Async scheduling (EngineConfig.async_scheduling): step n+1 is scheduled and launched before step
n's sampled tokens are read, and reads them on the device.

On this CPU the device computes as it is told, so nothing overlaps here; what is checked is that the
bookkeeping that makes the overlap possible is exact: the next step really is launched with its
tokens pending, and the streams that come out equal the plain loop's, delta for delta, through
sampling, stops, n > 1, logprobs, chunked prefill, preemption, prefix caching and abort.
(tests/engine/test_engine.py runs its whole suite in both modes too; tests/test_gpu.py compares the
two on CUDA, where async scheduling is the default.)
"""
from __future__ import annotations

import json
from collections import defaultdict

import pytest

from llmq.engine.block_manager import BlockManager
from llmq.engine.config import EngineConfig
from llmq.engine.llm import LLMEngine
from llmq.engine.scheduler import Scheduler
from llmq.engine.sequence import Sequence
from llmq.sampling_params import SamplingParams

BLOCK_SIZE = 8
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
         "One day, she saw a big, red ball. ")


def make_engine(stories_dir, async_scheduling: bool, **options) -> LLMEngine:
    options = {"dtype": "float32", "num_threads": 1, "block_size": BLOCK_SIZE, "kv_cache_bytes": 1 << 20,
               **options}
    engine = LLMEngine(EngineConfig(model=str(stories_dir), async_scheduling=async_scheduling, **options))
    assert engine.async_scheduling is async_scheduling and engine.stats()["async_scheduling"] is async_scheduling
    return engine


def block_bytes(stories_dir) -> int:
    config = json.loads((stories_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * BLOCK_SIZE * config["num_key_value_heads"] * head_dim * 4


def run_to_end(engine: LLMEngine, requests: dict[str, SamplingParams | tuple], max_steps: int = 3000):
    """Submit {request_id: (prompt, params)} at once, step to the end: every delta, by (request, sample)."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    streams = defaultdict(list)
    steps = 0
    while engine.has_unfinished():
        for delta in engine.step():
            streams[(delta.request_id, delta.index)].append(delta)
        steps += 1
        assert steps < max_steps
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return streams


def comparable(streams) -> dict:
    """The deltas as plain values; logprobs rounded (a finishing sequence's extra step changes a
    batch's shape, which may move a float in its last bits)."""
    def logprobs(delta):
        return None if delta.logprobs is None else [
            (lp.token_id, round(lp.logprob, 4), [(t, round(v, 4)) for t, v in lp.top]) for lp in delta.logprobs]
    return {key: [(d.text, d.token_ids, d.finished, d.finish_reason, d.stop_reason, logprobs(d)) for d in deltas]
            for key, deltas in streams.items()}


def test_the_next_step_is_launched_before_the_last_ones_tokens_are_read(stories_dir):
    plain, overlapped = make_engine(stories_dir, False), make_engine(stories_dir, True)
    params = SamplingParams(temperature=0, max_tokens=5)
    seq = overlapped.add_request("r", "Once upon a time", params)
    prompt_len = seq.num_tokens
    plain.add_request("r", "Once upon a time", params)
    first = plain.step()
    assert [d.token_ids for d in first] == [(plain._requests["r"][0].token_ids[-1],)]

    assert overlapped.step() == []  # the prompt's step is launched; its token is still on the device
    assert (seq.num_tokens, seq.num_computed_tokens, seq.num_pending_tokens) == (prompt_len, prompt_len, 1)
    second = overlapped.step()
    # This step computed the first generated token before the host had it, then read it.
    assert [d.token_ids for d in second] == [d.token_ids for d in first]
    assert (seq.num_tokens, seq.num_computed_tokens, seq.num_pending_tokens) == (prompt_len + 1, prompt_len + 1, 1)


def test_async_scheduling_streams_exactly_what_the_plain_loop_does(stories_dir):
    """A mixed workload on a small engine: a token budget that chunks the prompts, a KV cache that
    forces preemptions, a prefix cache, and fewer slots than the samples asked for."""
    shared = STORY * 2
    requests = {
        "greedy-short": ("Once upon a time", SamplingParams(temperature=0, max_tokens=40)),
        "greedy-long": (STORY * 3 + "Then", SamplingParams(temperature=0, max_tokens=30, logprobs=3)),
        "seeded": ("The little dog ran to the park", SamplingParams(temperature=0.9, top_p=0.9, seed=11,
                                                                   max_tokens=45)),
        "top-k": ("Lily", SamplingParams(temperature=1.0, top_k=20, seed=12, max_tokens=35)),
        "n3": ("Tom and Sam were best friends.", SamplingParams(temperature=0.8, seed=13, n=3, max_tokens=28)),
        "stop": ("One day, a little bird", SamplingParams(temperature=0, max_tokens=60, stop=["."])),
        "shared-a": (shared + "Tom had a big dog.", SamplingParams(temperature=0, max_tokens=24)),
        "shared-b": (shared + "The bird sang a song.", SamplingParams(temperature=0, max_tokens=36)),
    }
    # Room for any one request (the longest needs about 20 blocks), far from all of them at once.
    options = {"kv_cache_bytes": 28 * block_bytes(stories_dir), "max_num_batched_tokens": 48, "max_num_seqs": 6}
    plain_engine, async_engine = make_engine(stories_dir, False, **options), make_engine(stories_dir, True, **options)
    plain = run_to_end(plain_engine, requests)
    overlapped = run_to_end(async_engine, requests)

    assert comparable(overlapped) == comparable(plain)
    # The paths this was meant to cross were crossed, with the tokens in flight.
    assert not async_engine._requests  # every request finished and was let go
    counters = async_engine.counters
    assert counters.num_preemptions > 0 and counters.prefix_cache_hits > 0
    assert any(d[-1].stop_reason == "." for d in overlapped.values())
    assert sum(1 for key in overlapped if key[0] == "n3") == 3


def test_an_abort_while_its_token_is_in_flight_discards_that_token_and_frees_everything(stories_dir):
    engine = make_engine(stories_dir, True)
    params = SamplingParams(temperature=0, max_tokens=30)
    alone = run_to_end(make_engine(stories_dir, False), {"kept": ("Once upon a time", params)})
    aborted = engine.add_request("aborted", STORY, SamplingParams(temperature=0, max_tokens=30))
    engine.add_request("kept", "Once upon a time", params)
    streams = defaultdict(list)
    for _ in range(4):
        for delta in engine.step():
            streams[(delta.request_id, delta.index)].append(delta)
    assert aborted.num_pending_tokens == 1
    emitted = sum(len(d.token_ids) for d in streams[("aborted", 0)])
    assert engine.abort("aborted")
    while engine.has_unfinished():
        for delta in engine.step():
            streams[(delta.request_id, delta.index)].append(delta)
    last = streams[("aborted", 0)][-1]
    assert last.finish_reason == "abort" and sum(len(d.token_ids) for d in streams[("aborted", 0)]) == emitted
    assert aborted.num_pending_tokens == 0 and len(aborted.output_token_ids) == emitted
    assert comparable({k: v for k, v in streams.items() if k[0] == "kept"}) == comparable(alone)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# ---- the scheduler's part, in plain Python ---------------------------------------------------------


def test_a_sequence_with_a_token_in_flight_is_not_prefilled_until_the_token_arrives():
    """A sequence preempted while its token was on the device waits in the queue; its prefill needs
    that token, so it is admitted only once the token is in."""
    scheduler = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=64)
    seq = Sequence("r", [5, 6, 7], SamplingParams(max_tokens=8))
    scheduler.add(seq)
    first = scheduler.schedule()
    scheduler.launched(first)
    scheduler._preempt(seq, first)  # as a share or KV preemption in the next step's schedule would
    assert seq.num_pending_tokens == 1 and scheduler.num_waiting == 1

    assert not scheduler.schedule()
    assert scheduler.append_tokens(first, [9]) == [0]
    assert (seq.token_ids, seq.num_pending_tokens) == ([5, 6, 7, 9], 0)
    again = scheduler.schedule()
    assert again.seqs == [seq] and again.num_new_tokens == [4] and again.samplers == [seq]


def test_a_block_filled_by_a_pending_token_is_published_when_the_token_arrives():
    """Prefix caching hashes a full block's tokens. The step that computes a pending token which
    fills a block is scheduled before the token is known, so the block is published once it is, with
    the hash the plain loop gives it."""
    manager = BlockManager(16, 4)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    seq = Sequence("r", [5, 6, 7], SamplingParams(max_tokens=8))
    scheduler.add(seq)
    first = scheduler.schedule()
    scheduler.launched(first)
    second = scheduler.schedule()  # computes position 3, the pending token, which fills block 0
    assert second.seqs == [seq] and second.num_new_tokens == [1]
    scheduler.launched(second)
    assert manager.cached_blocks == {}

    assert scheduler.append_tokens(first, [9]) == [0]
    later = Sequence("later", [5, 6, 7, 9, 1], SamplingParams())
    assert manager.find_cached_prefix(later) == [seq.block_table[0]]

    plain_manager = BlockManager(16, 4)
    plain = Scheduler(plain_manager, max_num_seqs=4, max_num_batched_tokens=64)
    twin = Sequence("twin", [5, 6, 7], SamplingParams(max_tokens=8))
    plain.add(twin)
    plain.postprocess(plain.schedule(), [9])
    plain.schedule()
    assert list(plain_manager.cached_blocks) == list(manager.cached_blocks)


def test_a_token_that_arrives_for_a_finished_sequence_is_discarded():
    scheduler = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=64)
    a, b = Sequence("a", [1, 2], SamplingParams(max_tokens=8)), Sequence("b", [3, 4], SamplingParams(max_tokens=8))
    scheduler.add(a)
    scheduler.add(b)
    batch = scheduler.schedule()
    scheduler.launched(batch)
    scheduler.finish(a, "abort")
    assert scheduler.append_tokens(batch, [7, 8]) == [1]
    assert a.token_ids == [1, 2] and b.token_ids == [3, 4, 8]
    assert a.num_pending_tokens == b.num_pending_tokens == 0
    assert scheduler.counters.generation_tokens == 1


def test_async_scheduling_is_one_devices():
    with pytest.raises(ValueError, match="async_scheduling runs on one device"):
        EngineConfig(model="m", async_scheduling=True, tensor_parallel_size=2)
    assert not EngineConfig(model="m").uses_async_scheduling
    assert EngineConfig(model="m", device="cuda").uses_async_scheduling
    assert not EngineConfig(model="m", device="cuda", pipeline_parallel_size=2).uses_async_scheduling
    assert not EngineConfig(model="m", device="cuda", async_scheduling=False).uses_async_scheduling
