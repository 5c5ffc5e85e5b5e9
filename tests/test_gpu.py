"""The device path: the engine on CUDA. Marked `gpu`; skipped on machines without CUDA.

float32 on the device keeps greedy parity exact against transformers; bfloat16 (the CUDA default) is
checked for running cleanly and freeing its blocks."""
import pytest
import torch

from llmq.engine.config import EngineConfig
from llmq.engine.llm import LLM, LLMEngine
from llmq.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["Once upon a time", "The little dog ran", "Lily wanted to play with", "One day, Tom and his mom"]


@pytest.fixture(scope="module")
def hf_greedy(stories_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(stories_dir)
    result = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=48, min_new_tokens=48, do_sample=False)
        result[prompt] = out[0, ids.shape[1]:].tolist()
    return result


def test_cuda_float32_greedy_parity_and_batch_invariance(stories_dir, hf_greedy):
    llm = LLM(str(stories_dir), device="cuda", dtype="float32", kv_cache_bytes=1 << 20)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    together = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, together):
        assert out.token_ids == hf_greedy[prompt]
        assert llm.generate(prompt, params, use_tqdm=False)[0].token_ids == out.token_ids


def test_cuda_bfloat16_runs_and_frees_blocks(stories_dir):
    engine = LLMEngine(EngineConfig(model=str(stories_dir), device="cuda"))
    assert engine.model_runner.dtype == torch.bfloat16
    assert engine.model_runner.budget.activation_bytes > 0
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.7, seed=i, max_tokens=32, n=2))
    engine.step()
    engine.abort("r0")
    finished = 0
    while engine.has_unfinished():
        finished += sum(d.finished for d in engine.step())
    assert finished == 2 * len(PROMPTS)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.gpu2
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)], ids=["tp2", "pp2"])
def test_cuda_two_gpus_over_nccl_equal_transformers(stories_dir, hf_greedy, layout):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with LLM(str(stories_dir), device="cuda", dtype="float32", kv_cache_bytes=1 << 20, **layout) as llm:
        for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)):
            assert out.token_ids == hf_greedy[prompt]


@pytest.mark.gpu2
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_cuda_two_gpus_quantized_at_load_equal_one_gpu(stories_dir, quantization):
    """Each rank quantizes its shards as its part of the whole matrix: the same tokens as one GPU
    (float32: in bfloat16 the all-reduce of partial sums rounds differently from one product)."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    options = dict(device="cuda", dtype="float32", quantization=quantization, quantization_group_size=32)
    with LLM(str(stories_dir), **options) as llm:
        one = [out.token_ids for out in llm.generate(PROMPTS, params, use_tqdm=False)]
    with LLM(str(stories_dir), tensor_parallel_size=2, **options) as llm:
        assert [out.token_ids for out in llm.generate(PROMPTS, params, use_tqdm=False)] == one
