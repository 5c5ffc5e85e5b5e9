"""The decode kernels that read the paged cache in place against the torch path: Triton's
(llmq/model/triton_attention.py), on this machine's CPU under Triton's interpreter (on a GPU the same
tests run the compiled kernel), and the fused C++ one for a CPU (llmq/model/csrc/cpu_kernels.cpp),
which also takes a step's prompt chunks (fresh, or after cached tokens), each token as a decode.

The kernels read the cache through block tables in place; the torch path gathers blocks and
multiplies. They must give the same attention for every context length (one token, a block edge,
past Triton's 64-token tile), with grouped KV heads, for head sizes the C++ kernel takes in vector
registers and one it does not, and the same greedy tokens in an engine."""
from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch

from llmq.engine.config import EngineConfig
from llmq.engine.llm import LLM
from llmq.engine.step_input import DecodeGroupInput, PrefillSpanInput, StepInput
from llmq.model.attention import choose_attention_backend, longest_kernel_prompt, paged_attention
from llmq.model.cpu_kernels import TORCH_KERNELS, native_kernels, native_kernels_failure
from llmq.sampling_params import SamplingParams
from tests.model.conftest import bf16_widened, one_thread_takes_every_run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_KV_HEADS, NUM_HEADS, BLOCK_SIZE, NUM_BLOCKS = 2, 6, 4, 128
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
on_a_cpu = pytest.mark.skipif(DEVICE != "cpu", reason="the C++ kernel is for a CPU")
KERNELS = [pytest.param("triton", marks=needs_triton), pytest.param("cpu", marks=on_a_cpu)]


def _block_tables(lengths: list[int], order: list[int], block_size: int = BLOCK_SIZE) -> list[list[int]]:
    """Each context length's blocks, taken in turn from `order`."""
    tables, taken = [], 0
    for length in lengths:
        count = -(-length // block_size)
        tables.append(order[taken: taken + count])
        taken += count
    return tables


def _step(lengths: list[int], generator: torch.Generator, prefills: tuple[tuple[int, int], ...] = (),
          num_blocks: int = NUM_BLOCKS) -> StepInput:
    """Decodes of the given context lengths over random distinct blocks, then prompt chunks, each of
    (cached, new) tokens: `new` tokens after `cached` ones already in the cache."""
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = _block_tables(lengths, order)
    taken = sum(len(t) for t in tables)
    slots = [t[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE for t, n in zip(tables, lengths)]
    positions = [n - 1 for n in lengths]
    spans = []
    for cached, new in prefills:
        context = order[taken: taken + -(-(cached + new) // BLOCK_SIZE)]
        taken += len(context)
        spans.append(PrefillSpanInput(len(positions), new, cached, context))
        slots += [context[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached, cached + new)]
        positions += list(range(cached, cached + new))
    width = max((len(t) for t in tables), default=0)
    decodes = [DecodeGroupInput(0, [t + [0] * (width - len(t)) for t in tables], lengths)] if lengths else []
    rows = len(positions)
    return StepInput([0] * rows, positions, slots, decodes, spans, [], [])


def _operands(rows: int, head_dim: int, dtype: torch.dtype, generator: torch.Generator,
              num_blocks: int = NUM_BLOCKS, device: str = "cpu", num_heads: int = NUM_HEADS,
              block_size: int = BLOCK_SIZE):
    """Random caches [KVH, slots, Dh], and a step's q [rows, H, Dh], k and v [rows, KVH, Dh]."""
    k_cache, v_cache = (torch.randn(NUM_KV_HEADS, num_blocks * block_size, head_dim, generator=generator)
                        .to(device, dtype) for _ in range(2))
    q = torch.randn(rows, num_heads, head_dim, generator=generator).to(device, dtype)
    k, v = (torch.randn(rows, NUM_KV_HEADS, head_dim, generator=generator).to(device, dtype) for _ in range(2))
    return k_cache, v_cache, q, k, v


STEPS = {  # decodes' context lengths: one token, a block's edge, and the Triton kernel's 64-token tile's
    "decodes": ([1, 4, 5, 63, 64, 65, 130], ()),
    "decodes+chunk": ([1, 4, 5, 63, 64, 65, 130], ((9, 5),)),
    "decodes+prompts+chunk": ([3, 17], ((0, 7), (0, 1 + 2 * BLOCK_SIZE), (6, 3))),
    "prompts only": ([], ((0, 40), (0, 2), (5, 70))),
    # Chunks over several of Triton's 64-token query and key tiles, fresh and after cached tokens.
    "decodes+long chunks": ([5, 130], ((70, 90), (0, 130))),
}
# Steps whose longer prompt chunks the "cpu" kernel leaves to SDPA: (decodes, chunks, longest context it takes).
ROUTED_STEPS = {
    "a long chunk between short ones": ([3, 17], ((0, 7), (4, 40), (5, 20)), 32),
    "long prompts only": ([], ((0, 40), (0, 70)), 32),
}


# Head sizes: Triton's products pad them to at least 16 (8, 24). The C++ kernel holds a head of 1, 2, 4 or 8
# vectors in registers (on AVX2: 32 is 4, summing values in two running sums, 64 is 8, in one; on AVX-512
# 128 is 8 too), and takes any other size (24; 128 on AVX2) in its general loop.
KERNEL_CASES = ([pytest.param("triton", size, name, marks=needs_triton) for size in (8, 24) for name in STEPS]
                + [pytest.param("cpu", size, name, marks=on_a_cpu) for size in (24, 32, 64, 128) for name in STEPS])


@pytest.mark.parametrize("kernel, head_dim, step_name", KERNEL_CASES, indirect=["kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_attends_as_the_torch_path_does(kernel, head_dim, step_name, dtype):
    lengths, prefills = STEPS[step_name]
    generator = torch.Generator().manual_seed(7)
    step = _step(lengths, generator, prefills)
    k_cache, v_cache, q, k, v = _operands(step.num_tokens, head_dim, dtype, generator, device=DEVICE)
    outs = {}
    for paged_kernel in (None, kernel):
        _, _, meta = step.to_tensors(DEVICE, NUM_KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, paged_kernel=paged_kernel)
        TORCH_KERNELS.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)  # as the model does before attending
        assert (meta.paged_decodes is not None) == (paged_kernel == "cpu" or bool(paged_kernel and lengths))
        assert bool(meta.decodes) == (not paged_kernel and bool(lengths))
        # Both kernels take the prompt chunks: the C++ one in the decodes' call, Triton's in a launch of its own.
        assert len(meta.prefills) == (0 if paged_kernel else len(prefills))
        assert (meta.paged_prefills is not None) == (paged_kernel == "triton" and bool(prefills))
        outs[paged_kernel] = paged_attention(q, k, v, k_cache, v_cache, meta, head_dim ** -0.5).float()
    tolerance = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
                 torch.float16: dict(rtol=5e-3, atol=5e-3)}[dtype]
    torch.testing.assert_close(outs[kernel], outs[None], **tolerance)
    assert (outs[kernel].abs().sum(dim=1) > 0).all()  # every row written
    if kernel == "cpu":  # one thread taking every run, the second's pieces from its back (work_split.h)
        with one_thread_takes_every_run():
            alone = paged_attention(q, k, v, k_cache, v_cache, meta, head_dim ** -0.5).float()
        assert torch.equal(alone, outs[kernel])
    if kernel == "cpu" and dtype == torch.bfloat16:  # both of bfloat16's paths (csrc/bf16_widening.h)
        for widened in (False, True):
            with bf16_widened(widened):
                path = paged_attention(q, k, v, k_cache, v_cache, meta, head_dim ** -0.5).float()
            torch.testing.assert_close(path, outs[None], **tolerance)


@on_a_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step_name", list(ROUTED_STEPS))
def test_the_cpu_kernel_leaves_longer_prompt_chunks_to_sdpa(step_name, dtype):
    assert native_kernels() is not None, native_kernels_failure()
    lengths, prefills, longest = ROUTED_STEPS[step_name]
    generator = torch.Generator().manual_seed(11)
    step = _step(lengths, generator, prefills)
    head_dim = 64
    k_cache, v_cache, q, k, v = _operands(step.num_tokens, head_dim, dtype, generator)
    outs = {}
    for paged_kernel in (None, "cpu"):
        _, _, meta = step.to_tensors("cpu", NUM_KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, paged_kernel=paged_kernel,
                                     longest_kernel_prompt=longest)
        TORCH_KERNELS.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        outs[paged_kernel] = paged_attention(q, k, v, k_cache, v_cache, meta, head_dim ** -0.5).float()
        if paged_kernel:
            long_spans = [(c, n) for c, n in prefills if c + n > longest]
            assert [(s.num_cached, s.num_tokens) for s in meta.prefills] == long_spans  # SDPA takes exactly these
            assert (meta.paged_decodes is not None) == (bool(lengths) or len(long_spans) < len(prefills))
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(outs["cpu"], outs[None], **tolerance)
    assert (outs["cpu"].abs().sum(dim=1) > 0).all()


# Steps whose long chunks the "cpu" kernel's call gives its prompt kernel, where this build has one
# (csrc/prompt_attention.h: chunks with more than 128 of context whose tokens times query heads per KV head,
# 3 here, are at least 64; csrc/prompt_attention_amx.h: chunks of at least 8 tokens); the rest of the call,
# decodes and short chunks, each token as a decode.
# (decodes, chunks)
PROMPT_KERNEL_STEPS = {
    "a fresh long prompt": ([], ((0, 300),)),
    "long chunks after cached tokens, among decodes": ([3, 300], ((250, 40), (0, 17), (280, 22))),
    "a chunk too short for it, on a long context": ([5], ((400, 21), (0, 257))),
}


@on_a_cpu
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step_name", list(PROMPT_KERNEL_STEPS))
def test_the_cpu_kernels_call_attends_to_long_chunks_as_the_torch_path_does(step_name, dtype, head_dim):
    kernels = native_kernels()
    assert kernels is not None, native_kernels_failure()
    if not kernels.takes_prompt(head_dim, dtype):
        pytest.skip("no prompt kernel here for this dtype (bfloat16 on the matrix units; any on AVX2 CPUs without AVX-512)")
    lengths, prefills = PROMPT_KERNEL_STEPS[step_name]
    num_blocks = 512
    generator = torch.Generator().manual_seed(13)
    step = _step(lengths, generator, prefills, num_blocks=num_blocks)
    k_cache, v_cache, q, k, v = _operands(step.num_tokens, head_dim, dtype, generator, num_blocks=num_blocks)
    outs = {}
    for paged_kernel in (None, "cpu"):
        _, _, meta = step.to_tensors("cpu", NUM_KV_HEADS, num_blocks, BLOCK_SIZE, paged_kernel=paged_kernel,
                                     longest_kernel_prompt=None)
        TORCH_KERNELS.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        assert not meta.prefills or paged_kernel is None  # with "cpu", every chunk is the kernel's call's
        outs[paged_kernel] = paged_attention(q, k, v, k_cache, v_cache, meta, head_dim ** -0.5).float()
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(outs["cpu"], outs[None], **tolerance)
    assert (outs["cpu"].abs().sum(dim=1) > 0).all()


def test_the_longest_prompt_the_kernel_takes_shrinks_with_the_query_heads():
    assert longest_kernel_prompt(8) == 128
    assert longest_kernel_prompt(32) == 64
    assert longest_kernel_prompt(1) > longest_kernel_prompt(2) > longest_kernel_prompt(64)


def test_on_an_avx2_cpu_without_avx512_the_kernel_takes_prompts_up_to_512_tokens_whatever_the_heads():
    # There torch's SDPA is the slower of the two up to about 512 tokens at 8 heads (1,024 at 32).
    assert {longest_kernel_prompt(heads, avx2_only=True) for heads in (1, 8, 32, 64)} == {512}


def test_with_a_prompt_kernel_the_kernel_takes_every_chunk():
    assert longest_kernel_prompt(8, avx2_only=True, prompt_kernel=True) is None
    assert longest_kernel_prompt(32, prompt_kernel=True) is None


@on_a_cpu
def test_the_cpu_kernel_refuses_a_query_table_row_it_does_not_have():
    kernels = native_kernels()
    assert kernels is not None, native_kernels_failure()
    q = torch.randn(2, NUM_HEADS, 64)
    cache = torch.randn(NUM_KV_HEADS, NUM_BLOCKS * BLOCK_SIZE, 64)
    tables, lengths = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32)
    out = torch.empty(2, NUM_HEADS * 64)
    kernels.paged_decode_attention(q, cache, cache, tables, lengths, BLOCK_SIZE, 0.125, out,
                                   torch.tensor([0, 0], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="names block table row 1 of 1"):
        kernels.paged_decode_attention(q, cache, cache, tables, lengths, BLOCK_SIZE, 0.125, out,
                                       torch.tensor([0, 1], dtype=torch.int32))


@on_a_cpu
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [BLOCK_SIZE, 16])
def test_the_cpu_kernel_attends_every_query_head_of_a_kv_head(group, head_dim, dtype, block_size):
    # On AVX2 and AVX-512 it scores a block's keys for several query heads of a KV head at once (8, 4, 2 or
    # 1 heads, and 8 / heads keys, a pass) and sums values two heads at a time where the group is even:
    # every group size, against a plain softmax over each sequence's context; in blocks of 4 keys, and of
    # 16, where a pass of a block's keys for one head takes eight.
    kernels = native_kernels()
    assert kernels is not None, native_kernels_failure()
    lengths = [1, 3, 4, 9, 31, 70]
    generator = torch.Generator().manual_seed(group)
    tables = _block_tables(lengths, torch.randperm(NUM_BLOCKS, generator=generator).tolist(), block_size)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    k_cache, v_cache, q, _, _ = _operands(len(lengths), head_dim, dtype, generator, num_heads=NUM_KV_HEADS * group,
                                          block_size=block_size)
    scale = head_dim ** -0.5
    # bfloat16 both ways: in the CPU's dot products, and widened to float32 (csrc/bf16_widening.h).
    for path in ([None] if dtype == torch.float32 else [False, True]):
        out = torch.empty(len(lengths), NUM_KV_HEADS * group * head_dim, dtype=dtype)
        with bf16_widened(path) if path is not None else contextlib.nullcontext():
            kernels.paged_decode_attention(q, k_cache, v_cache, block_tables,
                                           torch.tensor(lengths, dtype=torch.int32), block_size, scale, out)
        for n, (length, table) in enumerate(zip(lengths, tables)):
            slots = [table[p // block_size] * block_size + p % block_size for p in range(length)]
            keys, values = (cache[:, slots].float().repeat_interleave(group, dim=0) for cache in (k_cache, v_cache))
            weights = torch.softmax(q[n].float().unsqueeze(1) @ keys.transpose(1, 2) * scale, dim=-1)
            expected = (weights @ values).reshape(-1)
            tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(out[n].float(), expected, **tolerance)


@pytest.fixture
def kernel(request):
    """A paged kernel's backend name; the C++ one must have been built here (a compiler and ninja)."""
    if request.param == "cpu":
        assert native_kernels() is not None, native_kernels_failure()
    return request.param


@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
def test_an_engine_generates_the_same_tokens_with_either_backend(stories_dir, kernel):
    # A shared prefix (prefix caching: a chunk after cached blocks), greedy and seeded samples.
    prompts = ["Once upon a time there was a little girl named Lily", "Once upon a time there was a big dog"]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=8, ignore_eos=True)
    runs = {}
    for backend in ("torch", kernel):
        # The torch run takes plain PyTorch throughout; the C++ kernel's, the fused norms and SiLU too.
        llm = LLM(str(stories_dir), device=DEVICE, dtype="float32", kv_cache_bytes=1 << 20, attention_backend=backend,
                  cpu_kernels=backend == "cpu")
        assert llm.engine.model_runner.attention_backend == backend
        runs[backend] = [out.outputs[0].token_ids for params in (greedy, seeded)
                         for out in llm.generate(prompts, params, use_tqdm=False)]
    assert runs[kernel] == runs["torch"]
    assert all(len(tokens) == 8 for tokens in runs["torch"])


@needs_triton
def test_the_backend_choice():
    assert choose_attention_backend("auto", "cpu") == "torch"
    assert choose_attention_backend("auto", "cpu", cpu_kernels=True) == "cpu"
    assert choose_attention_backend("torch", "cpu", cpu_kernels=True) == "torch"
    assert choose_attention_backend("torch", "cuda") == "torch"
    assert choose_attention_backend("auto", "cuda") == "triton"  # triton is installed here
    assert choose_attention_backend("cpu", "cpu", cpu_kernels=True) == "cpu"
    for device, built in (("cuda", True), ("cpu", False)):
        with pytest.raises(ValueError, match="fused C\\+\\+ kernel"):
            choose_attention_backend("cpu", device, cpu_kernels=built)
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model="m", attention_backend="flash")


@needs_triton
def test_triton_on_a_cpu_outside_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        choose_attention_backend("triton", "cpu")
