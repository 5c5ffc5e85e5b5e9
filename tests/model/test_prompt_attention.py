"""The CPU's prompt kernel (llmq/model/csrc/prompt_attention.h) against its twin, SDPA's causal attention
(attention.py's _prefill_attention): a prompt chunk's queries over its whole context, fresh or after
cached tokens, with its tokens in tiles (one token, a tile's edge, several tiles), grouped KV heads, the
head sizes it takes, every dtype the engine computes in, and keys and values that are views of other
tensors (the SDPA path's layout; the engine itself calls it through the paged cache). The kernel is
built where the panel products are (AVX2 CPUs without AVX-512); elsewhere these tests skip and the "cpu"
backend's long chunks stay SDPA's."""
from __future__ import annotations

import pytest
import torch

from llmq.model.attention import _prefill_attention
from llmq.model.cpu_kernels import native_kernels, native_kernels_failure


@pytest.fixture(scope="module")
def kernels():
    built = native_kernels()
    assert built is not None, native_kernels_failure()
    if not built.takes_prompt(64, torch.float32):
        pytest.skip("the prompt kernel for every dtype is built on AVX2 CPUs without AVX-512 only (where the panel "
                    "products are); tests/model/test_prompt_attention_amx.py has the matrix units' bfloat16 one")
    return built


TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
             torch.float16: dict(rtol=5e-3, atol=5e-3)}


def _attend_both_ways(kernels, n, cached, heads, kv_heads, head_dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, head_dim, generator=generator).to(dtype)
    keys, values = (torch.randn(kv_heads, cached + n, head_dim, generator=generator).to(dtype) for _ in range(2))
    scale = head_dim ** -0.5
    return (kernels.prompt_attention(q, keys, values, cached, scale).float(),
            _prefill_attention(q.float(), keys.float(), values.float(), cached, scale))


@pytest.mark.parametrize("n, cached", [(1, 0), (11, 0), (12, 0), (13, 0), (40, 0), (1, 9), (5, 27), (70, 130)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_the_kernel_attends_as_sdpa_does(kernels, n, cached, heads, kv_heads):
    got, expected = _attend_both_ways(kernels, n, cached, heads, kv_heads, 64, torch.float32)
    assert got.shape == (n, heads * 64)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("head_dim", [16, 32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_head_size_it_takes_and_every_dtype(kernels, head_dim, dtype):
    got, expected = _attend_both_ways(kernels, 29, 6, 6, 2, head_dim, dtype, seed=3)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


def test_a_long_prompt_over_many_tiles(kernels):
    got, expected = _attend_both_ways(kernels, 600, 0, 8, 4, 64, torch.float32, seed=5)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


def test_keys_and_values_may_be_views_with_strides_of_their_own(kernels):
    # As the SDPA path lays out a fresh prompt's: q, k and v slices of one qkv projection, k and v
    # transposed to [KVH, n, Dh]; and a value view into a wider cache-like tensor.
    generator = torch.Generator().manual_seed(9)
    qkv = torch.randn(33, 8 + 2 * 4, 64, generator=generator)
    q, keys = qkv[:, :8], qkv[:, 8:12].transpose(0, 1)
    wide = torch.randn(4, 80, 64, generator=generator)
    wide[:, :33] = qkv[:, 12:].transpose(0, 1)
    values = wide[:, :33]
    got = kernels.prompt_attention(q, keys, values, 0, 0.125)
    torch.testing.assert_close(got, _prefill_attention(q, keys, values.contiguous(), 0, 0.125), rtol=1e-5, atol=1e-5)


def test_it_refuses_what_it_cannot_take(kernels):
    assert not kernels.takes_prompt(24, torch.float32)  # values' panels are 16 columns: 24 is SDPA's
    q = torch.randn(3, 2, 24)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 16"):
        kernels.prompt_attention(q, torch.randn(1, 3, 24), torch.randn(1, 3, 24), 0, 0.2)
    q = torch.randn(3, 2, 64)
    with pytest.raises(RuntimeError, match=r"\[KVH, num_cached \+ n, head_dim\]"):
        kernels.prompt_attention(q, torch.randn(1, 4, 64), torch.randn(1, 4, 64), 0, 0.125)  # context 4, not 3
    with pytest.raises(RuntimeError, match="multiple of the KV heads"):
        kernels.prompt_attention(torch.randn(3, 3, 64), torch.randn(2, 3, 64), torch.randn(2, 3, 64), 0, 0.125)
