"""The bfloat16 decode kernel on the CPU's matrix units (llmq/model/csrc/decode_attention_amx.h): where 8 to
16 query heads share a KV head, a decode's scores and weighted values in tiles, against a plain softmax
over each context and against the AVX512-BF16 kernel it replaces there. Only the products' order of summing
differs from the latter (a probability can round to the next bfloat16), so their results differ by a
rounding at most. On a CPU without AMX these skip."""
from __future__ import annotations

import pytest
import torch

from llmq.model.cpu_kernels import native_kernels, native_kernels_failure
from tests.model.conftest import bf16_widened, scattered_block_tables

KV_HEADS = 2


@pytest.fixture(scope="module")
def kernels():
    built = native_kernels()
    assert built is not None, native_kernels_failure()
    if built.decode_attention_path(torch.bfloat16, 64, 8) != "amx":
        pytest.skip("no matrix units (AMX) here: the bfloat16 decode kernel for shared KV heads runs on them")
    yield built
    built._ops.allow_matrix_units(True)


def test_which_shapes_it_takes(kernels):
    # 8 to 16 query heads a KV head (with fewer, the AVX512-BF16 kernel measured faster; a tile has 16
    # columns), heads of whole tiles of 32 dimensions, bfloat16 only.
    for group in (8, 11, 16):
        for head_dim in (32, 64, 128):
            assert kernels.decode_attention_path(torch.bfloat16, head_dim, group) == "amx"
    with bf16_widened(False):  # the AVX512-BF16 kernel in its dot products (csrc/bf16_widening.h)
        for group in (1, 2, 4, 7, 17, 32):
            assert kernels.decode_attention_path(torch.bfloat16, 64, group) == "avx512-bf16"
        assert kernels.decode_attention_path(torch.bfloat16, 256, 8) == "avx512-bf16"
    assert kernels.decode_attention_path(torch.float32, 64, 8) == "vector"


def _paged_call(kernels, lengths, group, head_dim, block_size, chunk=(), seed=0):
    """One paged call: a decode for each context length, then a prompt chunk's tokens (cached, new) if
    given, each sequence's blocks scattered over a cache whose every other slot holds NaN. Returns the
    output and, for each output row, its context's keys and values [KVH, length, Dh] and query."""
    generator = torch.Generator().manual_seed(seed)
    contexts = list(lengths) + ([chunk[0] + chunk[1]] if chunk else [])
    tables, num_blocks = scattered_block_tables(contexts, block_size, generator, spare=4)
    k_cache, v_cache = (torch.full((KV_HEADS, num_blocks * block_size, head_dim), float("nan"), dtype=torch.bfloat16)
                        for _ in range(2))
    contents = []
    for row, length in enumerate(contexts):
        slots = [int(tables[row, p // block_size]) * block_size + p % block_size for p in range(length)]
        keys, values = (torch.randn(KV_HEADS, length, head_dim, generator=generator).to(torch.bfloat16)
                        for _ in range(2))
        k_cache[:, slots], v_cache[:, slots] = keys, values
        contents.append((keys, values))
    query_tables, context_lens = list(range(len(lengths))), list(lengths)
    seen = contents[:len(lengths)]
    if chunk:
        cached, new = chunk
        query_tables += [len(lengths)] * new
        context_lens += list(range(cached + 1, cached + new + 1))
        keys, values = contents[-1]
        seen += [(keys[:, :length], values[:, :length]) for length in range(cached + 1, cached + new + 1)]
    q = torch.randn(len(context_lens), KV_HEADS * group, head_dim, generator=generator).to(torch.bfloat16)
    out = torch.full((len(context_lens), KV_HEADS * group * head_dim), float("nan"), dtype=torch.bfloat16)
    kernels.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(context_lens, dtype=torch.int32),
                                   block_size, head_dim ** -0.5, out, torch.tensor(query_tables, dtype=torch.int32))
    return out, q, seen


def _softmax_attention(q, keys, values, group, head_dim):
    keys, values = (x.float().repeat_interleave(group, dim=0) for x in (keys, values))
    weights = torch.softmax(q.float().unsqueeze(1) @ keys.transpose(1, 2) * head_dim ** -0.5, dim=-1)
    return (weights @ values).reshape(-1)


LENGTHS = [1, 15, 16, 17, 31, 32, 33, 64, 200]


@pytest.mark.parametrize("block_size", [16, 8, 32, 5])
@pytest.mark.parametrize("group, head_dim", [(8, 64), (16, 32), (11, 128), (8, 128)])
def test_it_attends_as_a_softmax_over_the_context_does(kernels, block_size, group, head_dim):
    # Blocks of 16 or more hold 16 keys in a row, which it reads in place; in blocks of 8 or 5 it copies
    # them together first. The slots around each context hold NaN, which must not reach a result.
    out, q, seen = _paged_call(kernels, LENGTHS, group, head_dim, block_size, seed=block_size + group)
    assert not out.isnan().any()
    for n, (keys, values) in enumerate(seen):
        expected = _softmax_attention(q[n], keys, values, group, head_dim)
        torch.testing.assert_close(out[n].float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("block_size", [16, 8])
def test_it_gives_what_the_avx512_kernel_gives_to_a_rounding(kernels, block_size):
    """Decodes and a short prompt chunk's tokens (each taken as a decode), with the matrix units allowed
    and not: the rows agree to a rounding of a probability."""
    outs = []
    for allowed in (True, False):
        kernels._ops.allow_matrix_units(allowed)
        outs.append(_paged_call(kernels, LENGTHS, 8, 64, block_size, chunk=(40, 5), seed=7)[0])
    kernels._ops.allow_matrix_units(True)
    tiles, vectors = outs
    assert not tiles.isnan().any() and not vectors.isnan().any()
    torch.testing.assert_close(tiles.float(), vectors.float(), rtol=0, atol=2 ** -6)
