"""The Triton decode kernel (llmq/model/triton_attention.py) against the torch path, on this
machine's CPU under Triton's interpreter (on a GPU the same tests run the compiled kernel).

The kernel reads the cache through block tables in place; the torch path gathers blocks and
multiplies. Both must give the same attention for every context length (one token, a block edge,
past the kernel's 64-token tile), with grouped KV heads, and the same greedy tokens in an engine."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from llmq.engine.config import EngineConfig
from llmq.engine.llm import LLM
from llmq.engine.step_input import DecodeGroupInput, PrefillSpanInput, StepInput
from llmq.model.attention import choose_attention_backend, paged_attention
from llmq.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_KV_HEADS, NUM_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 2, 6, 24, 4, 128


def _step(lengths: list[int], generator: torch.Generator, prefill: tuple[int, int] | None = None) -> StepInput:
    """Decodes of the given context lengths over random distinct blocks, then optionally a prompt
    chunk of prefill[1] tokens after prefill[0] cached ones."""
    order = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    tables, taken = [], 0
    for length in lengths:
        count = -(-length // BLOCK_SIZE)
        tables.append(order[taken: taken + count])
        taken += count
    width = max(len(t) for t in tables)
    slots = [t[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE for t, n in zip(tables, lengths)]
    positions = [n - 1 for n in lengths]
    prefills = []
    if prefill:
        cached, new = prefill
        context = order[taken: taken + -(-(cached + new) // BLOCK_SIZE)]
        prefills.append(PrefillSpanInput(len(lengths), new, cached, context))
        slots += [context[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached, cached + new)]
        positions += list(range(cached, cached + new))
    decode = DecodeGroupInput(0, [t + [0] * (width - len(t)) for t in tables], lengths)
    rows = len(positions)
    return StepInput([0] * rows, positions, slots, [decode], prefills, [], [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_prefill", [False, True], ids=["decodes", "decodes+chunk"])
def test_kernel_attends_as_the_torch_path_does(dtype, with_prefill):
    generator = torch.Generator().manual_seed(7)
    lengths = [1, 4, 5, 63, 64, 65, 130]  # one token, a block's edge, and the kernel's 64-token tile's
    step = _step(lengths, generator, prefill=(9, 5) if with_prefill else None)
    rows = step.num_tokens
    k_cache, v_cache = (torch.randn(NUM_KV_HEADS, NUM_BLOCKS * BLOCK_SIZE, HEAD_DIM, generator=generator)
                        .to(DEVICE, dtype) for _ in range(2))
    q = torch.randn(rows, NUM_HEADS, HEAD_DIM, generator=generator).to(DEVICE, dtype)
    k, v = (torch.randn(rows, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(DEVICE, dtype) for _ in range(2))
    outs = {}
    for kernel in (False, True):
        _, _, meta = step.to_tensors(DEVICE, NUM_KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, paged_decodes=kernel)
        assert (meta.paged_decodes is not None) == kernel and (not meta.decodes) == kernel
        outs[kernel] = paged_attention(q, k, v, k_cache, v_cache, meta, HEAD_DIM ** -0.5).float()
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(outs[True], outs[False], **tolerance)


@pytest.mark.slow
def test_an_engine_generates_the_same_tokens_with_either_backend(stories_dir):
    # A shared prefix (prefix caching: a chunk after cached blocks), greedy and seeded samples.
    prompts = ["Once upon a time there was a little girl named Lily", "Once upon a time there was a big dog"]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=8, ignore_eos=True)
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(stories_dir), device=DEVICE, dtype="float32", kv_cache_bytes=1 << 20, attention_backend=backend)
        assert llm.engine.model_runner.attention_backend == backend
        runs[backend] = [out.outputs[0].token_ids for params in (greedy, seeded)
                         for out in llm.generate(prompts, params, use_tqdm=False)]
    assert runs["triton"] == runs["torch"]
    assert all(len(tokens) == 8 for tokens in runs["torch"])


def test_the_backend_choice():
    assert choose_attention_backend("auto", "cpu") == "torch"
    assert choose_attention_backend("torch", "cuda") == "torch"
    assert choose_attention_backend("auto", "cuda") == "triton"  # triton is installed here
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model="m", attention_backend="flash")


def test_triton_on_a_cpu_outside_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        choose_attention_backend("triton", "cpu")
