"""Tensor and pipeline parallelism on CPU: real rank processes over gloo, greedy output equal to one
rank and to transformers.

Models: stories260K (trained; GQA 8/4, tied embeddings) and random transformers-written ones chosen
to reach every sharding rule: a Qwen2 with q/k/v biases, 6 heads over 3 KV heads, an untied head and
a vocabulary that 3 ranks split unevenly (padding); a Llama with one KV head (replicated on every
rank), o_proj and MLP biases (added once, on rank 0) and tied embeddings (the last pipeline stage's
own copy of the head). Then the engine's features under both: chunked prefill, prefix caching and
preemption, and the exact bookkeeping (layer split, checkpoint slices, micro-batches).
"""
from __future__ import annotations

import shutil

import pytest
import torch
from test_parity import (
    KV_CACHE_BYTES,
    STORY_PROMPTS,
    assert_greedy_matches,
    greedy,
    random_prompts,
    small_config,
    teacher_forced_logprobs,
    write_random_model,
)
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from llmq.engine.llm import LLM
from llmq.engine.scheduler import ScheduledBatch
from llmq.engine.sequence import Sequence
from llmq.engine.step_input import StepInput, micro_batches
from llmq.model.loader import ModelLoadError
from llmq.model.model_config import ModelConfig
from llmq.model.pipeline_parallel import PipelineStage, stage_layers
from llmq.model.tensor_parallel import TensorParallelShape
from llmq.sampling_params import SamplingParams

LOGPROB_ATOL = 1e-4


def generate(folder, prompts, params, **options):
    kv_cache_bytes = options.pop("kv_cache_bytes", KV_CACHE_BYTES)
    with LLM(str(folder), kv_cache_bytes=kv_cache_bytes, **{"dtype": "float32", **options}) as llm:
        return llm.generate(prompts, params, use_tqdm=False)


def assert_same_outputs(outputs, reference, where: str) -> None:
    for i, (out, ref) in enumerate(zip(outputs, reference, strict=True)):
        assert out.token_ids == ref.token_ids, f"{where}, prompt {i}:\n{out.token_ids}\n{ref.token_ids}"
        for step, (lp, ref_lp) in enumerate(zip(out.logprobs or [], ref.logprobs or [])):
            assert abs(lp.logprob - ref_lp.logprob) <= LOGPROB_ATOL, f"{where}, prompt {i}, step {step}"


# ---- stories260K ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stories_reference(stories_dir):
    """transformers' greedy continuations and llmq's on one rank."""
    hf = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()
    outputs = generate(stories_dir, STORY_PROMPTS, greedy(32))
    hf_ids = []
    for out in outputs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                              min_new_tokens=32)
        hf_ids.append(ref[0, ids.shape[1]:].tolist())
    return outputs, hf_ids


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                                    dict(tensor_parallel_size=2, pipeline_parallel_size=2)],
                         ids=["tp2", "pp2", "tp2xpp2"])
def test_stories_parallel_equals_one_rank_and_transformers(stories_dir, stories_reference, layout):
    one_rank, hf_ids = stories_reference
    outputs = generate(stories_dir, STORY_PROMPTS, greedy(32), **layout)
    assert_same_outputs(outputs, one_rank, str(layout))
    assert [out.token_ids for out in outputs] == hf_ids


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp2", "pp2"])
def test_chunked_prefill_prefix_caching_and_preemption_under_parallelism(stories_dir, layout):
    """Prompts sharing a 40-token prefix, prefilled 16 tokens a step, in a cache too small for all
    of them at once: the parallel engine preempts (counted), reuses cached prefix blocks, and its
    greedy output equals one rank's under the same settings."""
    prefix = list(range(5, 45))
    prompts = [prefix + [50 + i, 60 + i] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    options = dict(max_num_batched_tokens=16, block_size=4, enable_prefix_caching=True, max_num_seqs=6)
    # 32 blocks of 4 tokens on every rank: tensor parallelism halves a block's bytes, a pipeline
    # stage holds fewer layers (the first, 3 of 5). Each request needs 17 blocks, 10 of them shared.
    block_bytes = {"tensor_parallel_size": 2 * 5 * 4 * 16 * 4, "pipeline_parallel_size": 2 * 3 * 4 * 32 * 4}
    reference = generate(stories_dir, prompts, params, kv_cache_bytes=32 * 2 * 5 * 4 * 32 * 4, **options)
    with LLM(str(stories_dir), dtype="float32", kv_cache_bytes=32 * next(block_bytes[k] for k in layout), **options, **layout) as llm:
        engine = llm.engine
        assert engine.block_manager.num_blocks == 32
        preempted, cached = [], []
        schedule, find_cached_prefix = engine.scheduler.schedule, engine.block_manager.find_cached_prefix

        def counting_schedule():
            batch = schedule()
            preempted.extend(batch.preempted)
            return batch

        def counting_find_cached_prefix(seq):
            blocks = find_cached_prefix(seq)
            cached.append(len(blocks))
            return blocks
        engine.scheduler.schedule = counting_schedule
        engine.block_manager.find_cached_prefix = counting_find_cached_prefix
        first = llm.generate(prompts[:1], params, use_tqdm=False)
        rest = llm.generate(prompts[1:], params, use_tqdm=False)
    assert preempted, "the cache was meant to be too small for every request at once"
    assert max(cached) >= 40 // 4, "the later prompts were meant to find the shared prefix cached"
    assert_same_outputs(first + rest, reference, str(layout))


# ---- random models: every sharding rule ------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen2_uneven(tmp_path_factory):
    config = small_config(Qwen2Config, num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                          intermediate_size=96, num_hidden_layers=3, use_sliding_window=False)
    return write_random_model(tmp_path_factory.mktemp("qwen2-gqa-6-3"), config, seed=3)


@pytest.fixture(scope="module")
def llama_mqa_biases(tmp_path_factory):
    config = small_config(LlamaConfig, num_attention_heads=4, num_key_value_heads=1, attention_bias=True,
                          mlp_bias=True, tie_word_embeddings=True)
    return write_random_model(tmp_path_factory.mktemp("llama-mqa-biases"), config, seed=4)


@pytest.mark.parametrize("model, layout", [
    ("qwen2_uneven", dict(tensor_parallel_size=3)),
    ("qwen2_uneven", dict(pipeline_parallel_size=2)),
    ("llama_mqa_biases", dict(tensor_parallel_size=2)),
    ("llama_mqa_biases", dict(pipeline_parallel_size=2)),
], ids=["qwen2-tp3", "qwen2-pp2", "llama-mqa-tp2", "llama-mqa-pp2"])
def test_random_models_parallel_equal_one_rank_and_transformers(request, model, layout):
    folder = request.getfixturevalue(model)
    prompts = random_prompts([5, 17, 9, 30])
    reference = generate(folder, prompts, greedy(12))
    outputs = generate(folder, prompts, greedy(12), **layout)
    assert_same_outputs(outputs, reference, f"{folder.name} {layout}")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        assert_greedy_matches(out.token_ids, teacher_forced_logprobs(hf, prompt, out.token_ids),
                              f"{folder.name} {layout}, prompt {i}")


# ---- bookkeeping, exactly --------------------------------------------------------------------------

def test_stage_layers_split_contiguously_earlier_stages_take_the_remainder():
    assert [stage_layers(5, 2, s) for s in range(2)] == [(0, 3), (3, 5)]
    assert [stage_layers(7, 3, s) for s in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert [stage_layers(4, 4, s) for s in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="more than the model's 2 layers"):
        stage_layers(2, 3, 0)


def test_pipeline_stage_maps_checkpoint_names_to_its_own_layers():
    last = PipelineStage.of(5, 2, 1)
    assert last.local_names("model.layers.4.mlp.up_proj.weight", tied=False) == ["model.layers.1.mlp.up_proj.weight"]
    assert last.local_names("model.layers.2.mlp.up_proj.weight", tied=False) == []
    assert last.local_names("model.embed_tokens.weight", tied=True) == ["lm_head.weight"]
    assert last.local_names("model.embed_tokens.weight", tied=False) == []
    first = PipelineStage.of(5, 2, 0)
    assert first.local_names("model.norm.weight", tied=True) == []
    assert first.local_names("model.embed_tokens.weight", tied=True) == ["model.embed_tokens.weight"]


def model_config(**overrides) -> ModelConfig:
    raw = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=16, intermediate_size=12,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=4)
    return ModelConfig.from_dict({**raw, **overrides})


def test_tensor_parallel_slices_of_each_checkpoint_tensor():
    shape = TensorParallelShape(model_config(), rank=1, size=2)
    layer = "model.layers.0"
    assert shape.checkpoint_slice(f"{layer}.self_attn.q_proj.weight") == (0, 8, 8)  # heads 2-3
    assert shape.checkpoint_slice(f"{layer}.self_attn.k_proj.bias") == (0, 4, 4)  # KV head 1
    assert shape.checkpoint_slice(f"{layer}.mlp.gate_proj.weight") == (0, 6, 6)
    assert shape.checkpoint_slice(f"{layer}.self_attn.o_proj.weight") == (1, 8, 8)
    assert shape.checkpoint_slice(f"{layer}.mlp.down_proj.weight") == (1, 6, 6)
    assert shape.checkpoint_slice(f"{layer}.mlp.down_proj.bias") is False  # added on rank 0
    assert TensorParallelShape(model_config(), 0, 2).checkpoint_slice(f"{layer}.mlp.down_proj.bias") is True
    assert shape.checkpoint_slice("model.embed_tokens.weight") == (0, 5, 5)
    assert shape.checkpoint_slice(f"{layer}.input_layernorm.weight") is True


def test_fewer_kv_heads_than_ranks_are_replicated_and_the_vocabulary_padded():
    config = model_config(num_key_value_heads=1, vocab_size=11)
    shapes = [TensorParallelShape(config, rank, 4) for rank in range(4)]
    assert [s.num_kv_heads for s in shapes] == [1, 1, 1, 1]
    assert [s.first_kv_head for s in shapes] == [0, 0, 0, 0]
    assert [s.vocab_rows for s in shapes] == [(0, 3), (3, 6), (6, 9), (9, 11)]  # 3 per rank, 1 of padding
    two_kv = [TensorParallelShape(model_config(), rank, 4) for rank in range(4)]
    assert [s.first_kv_head for s in two_kv] == [0, 0, 1, 1]  # query heads 0-1 use KV head 0


def test_a_size_that_does_not_split_the_model_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="num_attention_heads 4"):
        TensorParallelShape(model_config(), 0, 3)
    with pytest.raises(ValueError, match="num_key_value_heads 2"):
        TensorParallelShape(model_config(num_attention_heads=6, intermediate_size=12, head_dim=4), 0, 3)


def _batch(new_tokens: list[int], computed: list[int]) -> ScheduledBatch:
    seqs = []
    for i, (n, done) in enumerate(zip(new_tokens, computed)):
        seq = Sequence(f"r{i}", list(range(1, done + n + 1)), SamplingParams())
        seq.num_computed_tokens = done
        seq.block_table = list(range(10 * i, 10 * i + -(-(done + n) // 4)))
        seqs.append(seq)
    return ScheduledBatch(seqs, list(new_tokens), list(seqs), list(range(len(seqs))), [(1, 2)])


def test_micro_batches_cover_the_batch_once_balanced_by_tokens_with_samplers_in_order():
    batch = _batch([9, 1, 1, 5, 1, 1], [0, 7, 3, 0, 12, 2])
    parts = micro_batches(batch, block_size=4, count=2)
    assert [p.num_tokens for p in parts] == [9, 9]  # 9 | 5+1+1+1+1
    assert sorted(i for p in parts for i in p.sampler_indices) == list(range(6))
    assert [p.block_copies for p in parts] == [[(1, 2)], []]
    whole = StepInput.from_batch(batch, block_size=4)
    assert whole.sampler_indices == list(range(6)) and whole.num_tokens == 18
    # Decodes come first, longest context first; each sampler reads its own sequence's last row.
    assert whole.positions[:4] == [12, 7, 3, 2]
    assert [whole.input_ids[row] for row in whole.sample_rows] == [9, 8, 4, 5, 13, 3]
    assert micro_batches(batch, block_size=4, count=8)[5].num_tokens == 1  # no more parts than sequences


# ---- with at-load quantization: each rank quantizes its own shards -----------------------------------

@pytest.fixture(scope="module")
def llama_for_quantization(tmp_path_factory):
    """o_proj 64 input columns wide, down_proj 96: on two ranks, 32 and 48 each, so int4 groups of 32
    fall across the down_proj shards' boundary."""
    config = small_config(LlamaConfig, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
    return write_random_model(tmp_path_factory.mktemp("llama-for-quantization"), config, seed=5)


@pytest.mark.parametrize("quantization, layout", [
    ("int4", dict(tensor_parallel_size=2)),
    ("int8", dict(tensor_parallel_size=2)),
    ("int4", dict(pipeline_parallel_size=2)),
], ids=["int4-tp2", "int8-tp2", "int4-pp2"])
def test_quantized_at_load_under_parallelism_equals_one_rank(llama_for_quantization, quantization, layout):
    """Each rank quantizes its own shards, as its part of the whole matrix: a row-parallel shard's
    ranks agree on the range of each group they share (int8: the whole row), so the codes and scales
    are one rank's exactly."""
    prompts = random_prompts([5, 17, 9, 30])
    options = dict(quantization=quantization, quantization_group_size=32)
    reference = generate(llama_for_quantization, prompts, greedy(12), **options)
    outputs = generate(llama_for_quantization, prompts, greedy(12), **options, **layout)
    assert_same_outputs(outputs, reference, f"{quantization} {layout}")


# ---- refusals: a clean error on rank 0, no rank left behind -----------------------------------------

def test_a_size_that_does_not_split_the_model_is_refused_before_any_rank_starts(stories_dir):
    with pytest.raises(ValueError, match="num_attention_heads 8"):
        LLM(str(stories_dir), dtype="float32", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="more than the model's 5 layers"):
        LLM(str(stories_dir), dtype="float32", pipeline_parallel_size=6)


def test_a_checkpoint_every_rank_refuses_raises_on_rank_0_and_stops_the_ranks(stories_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bad"
    shutil.copytree(stories_dir, folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"] = weights["model.layers.1.mlp.up_proj.weight"][:-1]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="up_proj.weight' has shape"):
        LLM(str(folder), dtype="float32", tensor_parallel_size=2, kv_cache_bytes=KV_CACHE_BYTES)
    assert not torch.distributed.is_initialized()
    with LLM(str(stories_dir), dtype="float32", tensor_parallel_size=2, kv_cache_bytes=KV_CACHE_BYTES) as llm:  # and it can start again
        assert llm.generate("Once upon a time", greedy(4), use_tqdm=False)[0].token_ids
