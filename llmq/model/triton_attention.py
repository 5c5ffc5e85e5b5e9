"""Decode attention that reads the paged KV cache in place: one Triton kernel, for CUDA.

The torch path (llmq/model/attention.py) gathers each sequence's blocks into a contiguous copy, then
multiplies. On a GPU that copy is most of decode attention's memory traffic, and its shape changes
with every step's longest context, which rules out CUDA graphs. This kernel walks each sequence's
block table itself and stops at its own length, so its launch has the same shape whatever the
contexts are: a decode step captured once per batch size replays for any lengths.

One program per (sequence, query head). It reads the cache through the block table a tile of
BLOCK_N tokens at a time and keeps a running max and sum (the online softmax), so no score row is
ever stored; the arithmetic is in float32 whatever the cache's dtype.

Triton's interpreter (TRITON_INTERPRET=1, set before this module is imported) runs the same kernel on
CPU tensors, which is how the CPU test suite checks it against the torch path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
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
        positions = tile_start + tl.arange(0, BLOCK_N)
        in_context = positions < context_len
        blocks = tl.load(block_tables_ptr + seq * stride_bt + positions // block_size, mask=in_context, other=0)
        slots = blocks.to(tl.int64) * block_size + positions % block_size
        offsets = kv_head * stride_ch + slots[:, None] * stride_cs + dims[None, :]  # [BLOCK_N, BLOCK_D]
        tile_mask = in_context[:, None] & dim_ok[None, :]
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
