"""The device path: the engine on CUDA. Marked `gpu`; skipped on machines without CUDA.

float32 on the device keeps greedy parity exact against transformers; bfloat16 (what most checkpoints
name, and so what "auto" runs them in there) is checked for running cleanly and freeing its blocks. CUDA graphs and the Triton kernel must generate
what eager steps and the torch path do, and sampling must not wait for the device."""
import gc

import pytest
import torch

from llmq.engine.config import EngineConfig
from llmq.engine.llm import LLM, LLMEngine
from llmq.engine.sequence import Sequence
from llmq.model.sampler import SampledStep, sample_tokens
from llmq.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _release_device_memory():
    """Each test's engines gone before the next one plans its memory from what is allocated."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


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
    engine = LLMEngine(EngineConfig(model=str(stories_dir), device="cuda", dtype="bfloat16"))
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


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_graphs_generate_what_eager_steps_do(stories_dir, hf_greedy, backend):
    """Greedy float32 through captured decode graphs (batch sizes that pad: 5 requests in the bucket of
    8, then fewer as they finish) equals transformers, as the eager steps do."""
    prompts = PROMPTS + PROMPTS[:1]
    lengths = [48, 40, 33, 20, 9]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    runs = {}
    for graphs in (False, True):
        llm = LLM(str(stories_dir), device="cuda", dtype="float32", kv_cache_bytes=1 << 20, max_num_seqs=16,
                  cuda_graphs=graphs, attention_backend=backend)
        runner = llm.engine.model_runner
        assert runner.attention_backend == backend
        assert (runner.decode_graphs is not None) == graphs
        runs[graphs] = [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert runs[True] == runs[False]
    for prompt, n, tokens in zip(prompts, lengths, runs[True]):
        assert tokens == hf_greedy[prompt][:n]


def test_cuda_bfloat16_graphs_and_kernel_run_and_free_blocks(stories_dir):
    engine = LLMEngine(EngineConfig(model=str(stories_dir), device="cuda", dtype="bfloat16", max_num_seqs=32))
    assert engine.model_runner.attention_backend == "triton" and engine.model_runner.decode_graphs is not None
    for i in range(20):
        engine.add_request(f"r{i}", PROMPTS[i % 4], SamplingParams(temperature=0.8, seed=i, max_tokens=24 + i))
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_sampling_leaves_the_tokens_on_the_device_without_waiting(stories_dir):
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=1),
              SamplingParams(temperature=1.0, top_k=20, seed=2), SamplingParams(temperature=0.9, top_p=0.8, seed=3)]
    seqs = [Sequence(f"s{i}", [1, 2, 3], p) for i, p in enumerate(params)]
    logits = torch.randn(len(seqs), 512, device="cuda")
    SampledStep.launch(logits, seqs).result()  # the first call makes the generators and the pinned buffer
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = sample_tokens(logits, seqs)
        launched = SampledStep.launch(logits, seqs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.device.type == "cuda" and tokens.shape == (len(seqs),)
    assert tokens[0].item() == logits[0].argmax().item()
    token_ids, logprobs = launched.result()
    assert token_ids[0] == tokens[0].item() and logprobs == [None] * len(seqs)


def test_cuda_async_scheduling_generates_what_the_plain_loop_does(stories_dir):
    """On CUDA async scheduling is the default; the plain loop (launch, then read the tokens) must give
    the same tokens, text and finish reasons, sampled, with stops and n > 1, through graphs. (The
    logprobs are compared loosely: a finishing sequence's extra step changes the batch's shape, and with
    it cuBLAS's choice of kernel.)"""
    params = [SamplingParams(temperature=0, max_tokens=40, logprobs=2),
              SamplingParams(temperature=0.8, seed=5, max_tokens=33, n=2),
              SamplingParams(temperature=0.9, top_p=0.9, seed=6, max_tokens=48, stop=["."]),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    runs, logprobs = {}, {}
    for async_scheduling in (False, True):
        llm = LLM(str(stories_dir), device="cuda", dtype="float32", kv_cache_bytes=1 << 20, max_num_seqs=16,
                  async_scheduling=async_scheduling)
        assert llm.engine.async_scheduling is async_scheduling and llm.engine.model_runner.decode_graphs is not None
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        runs[async_scheduling] = [[(o.token_ids, o.text, o.finish_reason) for o in out.outputs] for out in outputs]
        logprobs[async_scheduling] = [lp.logprob for lp in outputs[0].logprobs]
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert runs[True] == runs[False]
    assert logprobs[True] == pytest.approx(logprobs[False], abs=1e-4)


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
