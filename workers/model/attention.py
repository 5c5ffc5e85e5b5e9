"""Attention over the paged KV cache, in plain PyTorch (runs on CPU and CUDA).

Each layer's cache is a pair of tensors [num_slots, num_kv_heads, head_dim], num_slots =
num_blocks * block_size; slot = block_table[pos // block_size] * block_size + pos % block_size.
A step's tokens come ordered as: one token for each decoding sequence, then the prompt chunks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """A chunk of `num_tokens` query tokens at rows [token_start, token_start + num_tokens) that
    follows `num_cached` tokens already in the cache (at `context_slots[:num_cached]`)."""

    token_start: int
    num_tokens: int
    num_cached: int
    context_slots: torch.Tensor | None  # [num_cached + num_tokens] slots, None when num_cached == 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decodes: int  # the first num_decodes rows are single-token decodes
    decode_slots: torch.Tensor | None  # [D, C] context slots of each decode, padded
    decode_pad_mask: torch.Tensor | None  # [D, 1, 1, C] True where a slot is padding
    prefills: list[PrefillSpan]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D]; k, v [T, KVH, D] for this step's tokens (already written to the cache).
    Returns [T, H * D]."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
    if meta.num_decodes:
        d = meta.num_decodes
        out[:d] = _decode_attention(q[:d], k_cache, v_cache, meta.decode_slots, meta.decode_pad_mask, scale)
    for span in meta.prefills:
        rows = slice(span.token_start, span.token_start + span.num_tokens)
        if span.context_slots is None:  # a fresh prompt: its own K/V are the whole context
            ctx_k, ctx_v = k[rows], v[rows]
        else:
            ctx_k, ctx_v = k_cache[span.context_slots], v_cache[span.context_slots]
        out[rows] = _prefill_attention(q[rows], ctx_k, ctx_v, span.num_cached, scale)
    return out


def _decode_attention(q, k_cache, v_cache, slots, pad_mask, scale):
    d, num_heads, head_dim = q.shape
    ctx = slots.shape[1]
    num_kv_heads = k_cache.shape[1]
    keys = k_cache[slots.reshape(-1)].view(d, ctx, num_kv_heads, head_dim).transpose(1, 2)  # [D, KVH, C, Dh]
    values = v_cache[slots.reshape(-1)].view(d, ctx, num_kv_heads, head_dim).transpose(1, 2)
    query = q.view(d, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [D, KVH, G, Dh]
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale  # [D, KVH, G, C]
    scores.masked_fill_(pad_mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, values).reshape(d, num_heads * head_dim)  # [D, KVH, G, Dh] -> [D, H*Dh]


def _prefill_attention(q, k, v, num_cached, scale):
    n, num_heads, head_dim = q.shape
    query = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, Dh]
    keys = k.transpose(0, 1).unsqueeze(0)  # [1, KVH, n + cached, Dh]
    values = v.transpose(0, 1).unsqueeze(0)
    if num_cached == 0:
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:  # query i sits at position num_cached + i and sees keys 0..num_cached + i
        ctx = keys.shape[2]
        allowed = torch.arange(ctx, device=q.device)[None, :] <= torch.arange(num_cached, num_cached + n,
                                                                              device=q.device)[:, None]
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=allowed, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(n, num_heads * head_dim)  # [n, H*Dh]
