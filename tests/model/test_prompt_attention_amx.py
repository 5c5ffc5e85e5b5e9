"""The bfloat16 prompt kernel on the CPU's matrix units (llmq/model/csrc/prompt_attention_amx.h): a prompt
chunk's causal attention in tiles of 16 tokens, against SDPA (the plain path's prefill) and against the
paged kernel taking each of the chunk's tokens as a decode, which it replaces in the paged call for chunks
of 8 tokens or more. Only the products' order of summing differs from the latter (a probability can round
to the next bfloat16), so their results differ by a rounding at most. On a CPU without AMX these skip
(bfloat16 chunks stay the decode kernel's there)."""
from __future__ import annotations

import pytest
import torch

from llmq.model.attention import _prefill_attention
from llmq.model.cpu_kernels import native_kernels, native_kernels_failure
from tests.model.conftest import scattered_block_tables


@pytest.fixture(scope="module")
def kernels():
    built = native_kernels()
    assert built is not None, native_kernels_failure()
    if built.tiled_products != "amx" or not built.takes_prompt(64, torch.bfloat16):
        pytest.skip("no matrix units (AMX) here: the bfloat16 prompt kernel runs on them")
    yield built
    built._ops.allow_matrix_units(True)


def _operands(n, cached, heads, kv_heads, head_dim, seed):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, head_dim, generator=generator).to(torch.bfloat16)
    keys, values = (torch.randn(kv_heads, cached + n, head_dim, generator=generator).to(torch.bfloat16)
                    for _ in range(2))
    return q, keys, values


@pytest.mark.parametrize("n, cached", [(1, 0), (15, 0), (16, 0), (17, 0), (40, 0), (5, 27), (70, 130), (33, 1)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_the_kernel_attends_as_sdpa_does(kernels, n, cached, heads, kv_heads):
    q, keys, values = _operands(n, cached, heads, kv_heads, 64, seed=n + cached)
    got = kernels.prompt_attention(q, keys, values, cached, 0.125)
    assert got.shape == (n, heads * 64) and got.dtype == torch.bfloat16
    expected = _prefill_attention(q.float(), keys.float(), values.float(), cached, 0.125)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
def test_every_head_size_it_takes(kernels, head_dim):
    assert kernels.takes_prompt(head_dim, torch.bfloat16)
    q, keys, values = _operands(29, 6, 6, 2, head_dim, seed=3)
    got = kernels.prompt_attention(q, keys, values, 6, head_dim ** -0.5)
    expected = _prefill_attention(q.float(), keys.float(), values.float(), 6, head_dim ** -0.5)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


def test_what_it_does_not_take(kernels):
    # Heads of 16 or 48 are not whole tiles of 32 dimensions; 256 would not fit the tile registers with a
    # tile's queries; float32 has no matrix-unit products.
    assert not any(kernels.takes_prompt(d, torch.bfloat16) for d in (16, 48, 256))
    assert not kernels.takes_prompt(64, torch.float32)


def _paged_call(kernels, chunks, decodes, block_size, head_dim=64, heads=8, kv_heads=4, seed=0):
    """One paged call over prompt chunks (cached, new tokens) and decodes (context lengths), every
    sequence's blocks scattered over the cache: (the call's output, how the rows split into chunks)."""
    generator = torch.Generator().manual_seed(seed)
    contexts = [c + n for c, n in chunks] + list(decodes)
    tables, num_blocks = scattered_block_tables(contexts, block_size, generator)
    slots = num_blocks * block_size
    k_cache, v_cache = (torch.randn(kv_heads, slots, head_dim, generator=generator).to(torch.bfloat16)
                        for _ in range(2))
    query_tables, lengths = [], []
    for row, (cached, new) in enumerate(chunks):
        query_tables += [row] * new
        lengths += list(range(cached + 1, cached + new + 1))
    for row, length in enumerate(decodes, start=len(chunks)):
        query_tables.append(row)
        lengths.append(length)
    q = torch.randn(len(lengths), heads, head_dim, generator=generator).to(torch.bfloat16)
    out = torch.full((len(lengths), heads * head_dim), float("nan"), dtype=torch.bfloat16)
    kernels.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32),
                                   block_size, head_dim ** -0.5, out, torch.tensor(query_tables, dtype=torch.int32))
    return out


def _both_ways(kernels, chunks, decodes, block_size, seed=0):
    """The paged call with the matrix units allowed (long chunks the prompt kernel's) and not (every
    token a decode)."""
    outs = []
    for allowed in (True, False):
        kernels._ops.allow_matrix_units(allowed)
        outs.append(_paged_call(kernels, chunks, decodes, block_size, seed=seed))
    kernels._ops.allow_matrix_units(True)
    return outs


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_in_the_paged_call_it_gives_what_each_token_as_a_decode_gives(kernels, block_size):
    """Chunks fresh and after cached tokens, short (each token a decode either way) and long, among
    decodes: every row is written; the decodes' and the short chunks' rows are the decode kernel's
    either way, bit for bit; the long chunks' rows agree to a rounding."""
    chunks = [(0, 40), (0, 7), (0, 8), (130, 21), (3, 100), (0, 16), (50, 3)]
    decodes = [9, 300, 1]
    tiles, decoded = _both_ways(kernels, chunks, decodes, block_size)
    assert not tiles.isnan().any() and not decoded.isnan().any()
    long_rows = torch.zeros(tiles.shape[0], dtype=torch.bool)
    start = 0
    for _, new in chunks:
        long_rows[start:start + new] = new >= 8
        start += new
    assert torch.equal(tiles[~long_rows], decoded[~long_rows])
    torch.testing.assert_close(tiles[long_rows].float(), decoded[long_rows].float(), rtol=0, atol=2 ** -6)
    # The long chunks went another way: somewhere their sums rounded otherwise.
    assert not torch.equal(tiles[long_rows], decoded[long_rows])


def test_a_chunk_below_eight_tokens_stays_each_token_a_decode(kernels):
    tiles, decoded = _both_ways(kernels, [(0, 7), (20, 5), (0, 1)], [12], 16, seed=4)
    assert torch.equal(tiles, decoded)
