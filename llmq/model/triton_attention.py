"""Attention that reads the paged KV cache in place: Triton kernels, for CUDA.

The torch path (llmq/model/attention.py) gathers each sequence's blocks into a contiguous copy, then
multiplies, and attends to each prompt chunk in a call of its own. On a GPU that copy is most of decode
attention's memory traffic, its shape changes with every step's longest context (which rules out CUDA
graphs), and a step of many short prompts spends its time launching a few calls per prompt and layer.

- The decode kernel walks each sequence's block table itself and stops at its own length, so its
  launch has the same shape whatever the contexts are: a decode step captured once per batch size
  replays for any lengths. One program per (sequence, query head).
- The prefill kernel takes every prompt chunk of a step in one launch, fresh prompts and chunks after
  cached tokens alike (their new K/V are in the cache already): one program per (chunk, tile of
  BLOCK_M query tokens, query head), causal at each query's own position. Its products are tl.dot's,
  in IEEE float32 for a float32 cache (TF32 would break parity with the reference).

Both keep a running max and sum (the online softmax), so no score row is ever stored, and accumulate
in float32 whatever the cache's dtype.

Triton's interpreter (TRITON_INTERPRET=1, set before this module is imported) runs the same kernels on
CPU tensors, which is how the CPU test suite checks them against the torch path.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


# Triton compiles a kernel again for an integer argument that is 1, or a multiple of 16, where it was not
# before. A block table's width changes from step to step (steps with prompt chunks run eagerly, with
# tables as wide as their longest sequence needs), so it is left out of that specialization: otherwise a
# new width could cost a compilation in the middle of serving.
_VARYING = ["stride_bt"]


@triton.jit
def _cache_tile(block_table_ptr, positions, context_end, kv_head, stride_ch, stride_cs, dims, dim_ok,
                block_size: tl.constexpr):
    """Where one KV head's keys (or values) at `positions` [BLOCK_N] of a sequence are in its cache:
    offsets [BLOCK_N, BLOCK_D] through the sequence's block table (at block_table_ptr), the mask of
    those in the context (positions before context_end, the head's dims), and in_context [BLOCK_N].
    A position past the context reads block 0 (masked, never used)."""
    in_context = positions < context_end
    blocks = tl.load(block_table_ptr + positions // block_size, mask=in_context, other=0)
    slots = blocks.to(tl.int64) * block_size + positions % block_size
    offsets = kv_head * stride_ch + slots[:, None] * stride_cs + dims[None, :]
    return offsets, in_context[:, None] & dim_ok[None, :], in_context


@triton.jit(do_not_specialize=_VARYING)
def _paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
                         scale, stride_qt, stride_qh, stride_ch, stride_cs, stride_bt, stride_ot,
                         queries_per_kv: tl.constexpr, head_dim: tl.constexpr, block_size: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // queries_per_kv
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q = tl.load(q_ptr + seq * stride_qt + head * stride_qh + dims, mask=dim_ok, other=0.0).to(tl.float32)
    context_len = tl.load(context_lens_ptr + seq)
    running_max = tl.full([1], float("-inf"), tl.float32)
    running_sum = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for tile_start in range(0, context_len, BLOCK_N):
        offsets, tile_mask, in_context = _cache_tile(block_tables_ptr + seq * stride_bt,
                                                     tile_start + tl.arange(0, BLOCK_N), context_len, kv_head,
                                                     stride_ch, stride_cs, dims, dim_ok, block_size)
        keys = tl.load(k_cache_ptr + offsets, mask=tile_mask, other=0.0).to(tl.float32)
        scores = tl.sum(keys * q[None, :], axis=1) * scale  # [BLOCK_N]
        scores = tl.where(in_context, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=0))
        rescale = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max)  # [BLOCK_N], 0 outside the context
        values = tl.load(v_cache_ptr + offsets, mask=tile_mask, other=0.0).to(tl.float32)
        acc = acc * rescale + tl.sum(values * weights[:, None], axis=0)
        running_sum = running_sum * rescale + tl.sum(weights, axis=0)
        running_max = new_max
    out = acc / running_sum
    tl.store(out_ptr + seq * stride_ot + head * head_dim + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                           scale: float, out: torch.Tensor) -> None:
    """q [N, H, Dh] (one query token per sequence); k_cache, v_cache [KVH, slots, Dh];
    block_tables int32 [N, max_blocks]; context_lens int32 [N], each at least 1 and at most
    max_blocks * block_size (this token included). Writes out [N, H * Dh]."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    if num_seqs == 0:
        return
    if k_cache.stride(2) != 1 or q.stride(2) != 1 or out.stride(1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("paged_decode_attention needs the head dimension contiguous in q, the caches and out, "
                         "and the two caches laid out alike")
    _paged_decode_kernel[(num_seqs, num_heads)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0), out.stride(0),
        queries_per_kv=num_heads // num_kv_heads, head_dim=head_dim, block_size=block_size,
        BLOCK_N=64, BLOCK_D=triton.next_power_of_2(head_dim))


@triton.jit(do_not_specialize=_VARYING)
def _paged_prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, token_starts_ptr, num_tokens_ptr,
                          num_cached_ptr, out_ptr, scale, stride_qt, stride_qh, stride_ch, stride_cs, stride_bt,
                          stride_ot, queries_per_kv: tl.constexpr, head_dim: tl.constexpr, block_size: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          PRECISION: tl.constexpr, DOT_IN_FLOAT32: tl.constexpr):
    chunk = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    count = tl.load(num_tokens_ptr + chunk)
    if tile * BLOCK_M < count:  # the grid is sized for the step's longest chunk
        token_start = tl.load(token_starts_ptr + chunk)
        cached = tl.load(num_cached_ptr + chunk)
        kv_head = head // queries_per_kv
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < count
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < head_dim
        q = tl.load(q_ptr + (token_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        if DOT_IN_FLOAT32:
            q = q.to(tl.float32)
        # A row past the chunk attends as its last token does (finite, never stored).
        query_positions = cached + tl.minimum(rows, count - 1)
        context_end = cached + tl.minimum(tile * BLOCK_M + BLOCK_M, count)  # the tile's last query's keys
        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for key_start in range(0, context_end, BLOCK_N):
            positions = key_start + tl.arange(0, BLOCK_N)
            offsets, tile_mask, in_context = _cache_tile(block_tables_ptr + chunk * stride_bt, positions, context_end,
                                                         kv_head, stride_ch, stride_cs, dims, dim_ok, block_size)
            keys = tl.load(k_cache_ptr + offsets, mask=tile_mask, other=0.0)
            values = tl.load(v_cache_ptr + offsets, mask=tile_mask, other=0.0)
            if DOT_IN_FLOAT32:
                keys, values = keys.to(tl.float32), values.to(tl.float32)
            scores = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N]
            allowed = (positions[None, :] <= query_positions[:, None]) & in_context[None, :]
            scores = tl.where(allowed, scores, float("-inf"))
            # The first tile holds position 0, which every query sees: the max is finite from then on.
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            rescale = tl.exp(running_max - new_max)
            weights = tl.exp(scores - new_max[:, None])
            acc = acc * rescale[:, None] + tl.dot(weights.to(values.dtype), values, input_precision=PRECISION)
            running_sum = running_sum * rescale + tl.sum(weights, axis=1)
            running_max = new_max
        out = acc / running_sum[:, None]
        tl.store(out_ptr + (token_start + rows)[:, None] * stride_ot + head * head_dim + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, token_starts: torch.Tensor, num_tokens: torch.Tensor,
                            num_cached: torch.Tensor, longest_chunk: int, block_size: int, scale: float,
                            out: torch.Tensor) -> None:
    """Every prompt chunk of a step: chunk c's num_tokens[c] query rows start at row token_starts[c] of
    q [T, H, Dh] and follow num_cached[c] tokens already in the cache; its new tokens' K/V are in the
    cache too, through block_tables int32 [C, max_blocks] (a row per chunk, covering its context). The
    per-chunk vectors are int32 [C]; `longest_chunk` is the largest of num_tokens (it sizes the grid).
    Writes the chunks' rows of out [T, H * Dh]."""
    num_chunks = num_tokens.shape[0]
    _, num_heads, head_dim = q.shape
    if num_chunks == 0:
        return
    if k_cache.stride(2) != 1 or q.stride(2) != 1 or out.stride(1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("paged_prefill_attention needs the head dimension contiguous in q, the caches and out, "
                         "and the two caches laid out alike")
    block_m = 64 if q.element_size() < 4 else 32  # float32 tiles take twice the shared memory
    _paged_prefill_kernel[(num_chunks, triton.cdiv(longest_chunk, block_m), num_heads)](
        q, k_cache, v_cache, block_tables, token_starts, num_tokens, num_cached, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0), out.stride(0),
        queries_per_kv=num_heads // k_cache.shape[0], head_dim=head_dim, block_size=block_size,
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),  # tl.dot's least
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # Triton's interpreter multiplies 16-bit floats wrongly in tl.dot (3.9 here): there the tests
        # check the kernel with its products in float32; compiled, they stay in the cache's dtype.
        DOT_IN_FLOAT32=os.environ.get("TRITON_INTERPRET") == "1")
