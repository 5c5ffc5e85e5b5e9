"""DecodeGraphs (llmq/engine/decode_graphs.py): the static buffers, buckets and padding that CUDA
graphs replay, run eagerly on this CPU against the plain step. (Capture itself is tested on a GPU,
in tests/test_gpu.py.)"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from llmq.engine.config import EngineConfig
from llmq.engine.decode_graphs import batch_buckets
from llmq.engine.llm import LLMEngine
from llmq.engine.step_input import StepInput
from llmq.sampling_params import SamplingParams

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def _decoding_engine(stories_dir, backend: str, num_prompts: int) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=str(stories_dir), dtype="float32", kv_cache_bytes=1 << 20, max_num_seqs=8,
                                    attention_backend=backend, prepack_weights=False))
    prompts = ["Once upon a time", "The little dog ran to the park", "Lily", "One day, Tom and his mom went"]
    for i in range(num_prompts):
        engine.add_request(f"r{i}", prompts[i % len(prompts)], SamplingParams(temperature=0, max_tokens=64))
    for _ in range(3):  # prefill, then a couple of decodes, so the contexts differ in length
        engine.step()
    return engine


# Triton's interpreter is slow: the kernel's bucket once, its agreement in an engine is in
# tests/model/test_paged_attention_kernels.py.
@pytest.mark.parametrize("backend, num_seqs", [("torch", 3), ("torch", 5),  # padded to the buckets of 4 and 8
                                               pytest.param("triton", 3, marks=needs_triton)])
def test_a_padded_decode_step_equals_the_plain_one_and_writes_only_its_slots(stories_dir, backend, num_seqs):
    engine = _decoding_engine(stories_dir, backend, num_seqs)
    runner = engine.model_runner
    graphs = runner.make_decode_graphs(capture=False)
    step = StepInput.from_batch(engine.scheduler.schedule(), runner.block_size)
    assert graphs.accepts(step) and step.num_tokens == num_seqs
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]

    with torch.inference_mode():
        replayed = graphs.run(step)
        after_replay = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        plain = runner.execute([step])

    torch.testing.assert_close(replayed, plain, rtol=1e-5, atol=1e-5)
    assert torch.equal(replayed.argmax(-1), plain.argmax(-1))
    # The replay changed the step's own slots and the scratch block, nothing else; the scratch block is
    # one the block manager never hands out.
    assert graphs.scratch_block == engine.block_manager.num_blocks == runner.num_cache_blocks - 1
    scratch = range(graphs.scratch_block * runner.block_size, (graphs.scratch_block + 1) * runner.block_size)
    changed = set(step.slots) | set(scratch)
    for (k0, v0), (k1, v1) in zip(before, after_replay):
        for old, new in ((k0, k1), (v0, v1)):
            differs = (old != new).any(dim=2).any(dim=0).nonzero().flatten().tolist()
            assert differs and set(differs) <= changed
            assert set(step.slots) <= set(differs)


def test_steps_it_does_not_replay(stories_dir):
    engine = LLMEngine(EngineConfig(model=str(stories_dir), dtype="float32", kv_cache_bytes=1 << 20, max_num_seqs=4))
    graphs = engine.model_runner.make_decode_graphs(capture=False)
    engine.add_request("a", "Once upon a time", SamplingParams(temperature=0, max_tokens=8))
    prefill = StepInput.from_batch(engine.scheduler.schedule(), engine.model_runner.block_size)
    assert prefill.prefills and not graphs.accepts(prefill)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_engine_stepping_through_the_graph_path_generates_the_same_tokens(stories_dir, async_scheduling):
    """The path a CUDA engine takes for every decode step, eagerly: the same greedy tokens as the plain
    path, with requests joining and finishing (the bucket changes from step to step). With async
    scheduling, as on CUDA, the graphs' input ids are read from the last step's sampled tokens."""
    runs = {}
    for through_graphs in (False, True):
        engine = LLMEngine(EngineConfig(model=str(stories_dir), dtype="float32", kv_cache_bytes=1 << 20,
                                        max_num_seqs=8, async_scheduling=async_scheduling and through_graphs))
        if through_graphs:
            engine.model_runner.decode_graphs = engine.model_runner.make_decode_graphs(capture=False)
            engine.model_runner.greedy_head = False  # as an engine with graphs has it: they return logits
        lengths = [5, 9, 14, 3, 11]
        for i, n in enumerate(lengths):
            engine.add_request(f"r{i}", ["Once upon a time", "The cat sat"][i % 2],
                               SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for delta in engine.step():
                tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
        runs[through_graphs] = tokens
        assert [len(tokens[f"r{i}"]) for i in range(len(lengths))] == lengths
    assert runs[True] == runs[False]
