"""Attention over the paged KV cache, in plain PyTorch (runs on CPU and CUDA).

Each layer's cache is a pair of tensors [num_kv_heads, num_blocks * block_size, head_dim]; token
position p of a sequence lives at slot block_table[p // block_size] * block_size + p % block_size.
Head-major, so gathering a sequence's blocks yields each head's keys contiguously: the products
read them in place instead of copying them into another layout (the copy, not the arithmetic,
dominates decode attention on a CPU).
A step's tokens come ordered as: one token for each decoding sequence, then the prompt chunks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """A chunk of `num_tokens` query tokens at rows [token_start, token_start + num_tokens) that
    follows `num_cached` tokens already in the cache, in `context_blocks` (None when num_cached == 0)."""

    token_start: int
    num_tokens: int
    num_cached: int
    context_blocks: torch.Tensor | None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    block_size: int
    num_decodes: int  # the first num_decodes rows are single-token decodes
    decode_block_tables: torch.Tensor | None  # [D, max_blocks], padded with block 0
    decode_pad_mask: torch.Tensor | None  # [1, D, 1, max_blocks * block_size], True on padding
    prefills: list[PrefillSpan]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, KVH, Dh] into their slots."""
    k_cache.index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.index_copy_(1, slot_mapping, v.transpose(0, 1))


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """cache [KVH, slots, Dh], block_tables [..., nb] -> [KVH, ..., nb * block_size, Dh]."""
    num_kv_heads, _, head_dim = cache.shape
    blocks = cache.view(num_kv_heads, -1, block_size * head_dim)[:, block_tables]  # [KVH, ..., nb, bs*Dh]
    return blocks.view(*blocks.shape[:-2], -1, head_dim)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, Dh]; k, v [T, KVH, Dh] for this step's tokens (already written to the cache).
    Returns [T, H * Dh]."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
    if meta.num_decodes:
        d = meta.num_decodes
        keys = gather_blocks(k_cache, meta.decode_block_tables, meta.block_size)  # [KVH, D, C, Dh]
        values = gather_blocks(v_cache, meta.decode_block_tables, meta.block_size)
        out[:d] = _decode_attention(q[:d], keys, values, meta.decode_pad_mask, scale)
    for span in meta.prefills:
        rows = slice(span.token_start, span.token_start + span.num_tokens)
        if span.context_blocks is None:  # a fresh prompt: its own K/V are the whole context
            keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)  # [KVH, n, Dh]
        else:
            context = span.num_cached + span.num_tokens
            keys = gather_blocks(k_cache, span.context_blocks, meta.block_size)[:, :context]
            values = gather_blocks(v_cache, span.context_blocks, meta.block_size)[:, :context]
        out[rows] = _prefill_attention(q[rows], keys, values, span.num_cached, scale)
    return out


def _decode_attention(q, keys, values, pad_mask, scale):
    """q [D, H, Dh]; keys, values [KVH, D, C, Dh]; pad_mask [1, D, 1, C]."""
    d, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[0]
    group = num_heads // num_kv_heads
    query = q.view(d, num_kv_heads, group, head_dim).transpose(0, 1)  # [KVH, D, G, Dh]
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale  # [KVH, D, G, C]
    scores.masked_fill_(pad_mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs, values)  # [KVH, D, G, Dh]
    return out.transpose(0, 1).reshape(d, num_heads * head_dim)


def _prefill_attention(q, keys, values, num_cached, scale):
    """q [n, H, Dh]; keys, values [KVH, num_cached + n, Dh]. Causal, query i at position num_cached + i."""
    n, num_heads, head_dim = q.shape
    query = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, Dh]
    keys, values = keys.unsqueeze(0), values.unsqueeze(0)  # [1, KVH, ctx, Dh]
    if num_cached == 0:
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        ctx = keys.shape[2]
        allowed = (torch.arange(ctx, device=q.device)[None, :]
                   <= torch.arange(num_cached, num_cached + n, device=q.device)[:, None])  # [n, ctx]
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=allowed, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(n, num_heads * head_dim)  # [n, H*Dh]
