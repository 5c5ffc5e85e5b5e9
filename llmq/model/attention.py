"""Attention over the paged KV cache, in plain PyTorch (runs on CPU and CUDA).

Each layer's cache is a pair of tensors [num_kv_heads, num_blocks * block_size, head_dim]; token
position p of a sequence lives at slot block_table[p // block_size] * block_size + p % block_size.
Head-major, so gathering a sequence's blocks yields each head's keys contiguously: the products
read them in place instead of copying them into another layout.
A step's tokens come ordered as: the single-token decodes (in groups), then the prompt chunks.

Three ways to attend for the decodes (EngineConfig.attention_backend): "torch" gathers each group's blocks
and multiplies (DecodeGroup); "triton" and "cpu" hand all of them to one kernel that reads the cache
through the block tables in place (PagedDecodes): "triton" for CUDA (llmq/model/triton_attention.py),
where it also keeps a decode step's shapes fixed for CUDA graphs, "cpu" the fused C++ kernel
(llmq/model/cpu_kernels.py). Prompt chunks take SDPA, a call each, except with "triton", whose prefill
kernel takes all of a step's chunks in one launch (PagedPrefills), and with "cpu", whose kernel takes them
in the same call as the decodes: short ones each token as a decode at its position, long ones in its prompt
kernel where this CPU's build has one for the dtype (csrc/prompt_attention_amx.h for bfloat16 on the matrix
units, csrc/prompt_attention.h on AVX2), so that it takes every chunk; else only the short ones
(longest_kernel_prompt).
"""
from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmq.model.cpu_kernels import native_kernels


@dataclass
class PrefillSpan:
    """A chunk of `num_tokens` query tokens at rows [token_start, token_start + num_tokens) that
    follows `num_cached` tokens already in the cache."""

    token_start: int
    num_tokens: int
    num_cached: int
    context_rows: torch.Tensor | None  # block_rows() of the context's blocks; None when num_cached == 0


@dataclass
class DecodeGroup:
    """`num_tokens` single-token decodes at rows [token_start, token_start + num_tokens), padded to a
    common context length. Decodes come in a few groups of similar length, so that little padding
    is gathered: on a CPU the gather, not the arithmetic, is what decode attention costs."""

    token_start: int
    num_tokens: int
    cache_rows: torch.Tensor  # block_rows() of the [N, max_blocks] block tables, padded with block 0
    pad_mask: torch.Tensor  # [1, N, 1, max_blocks * block_size], True on padding

    @classmethod
    def over(cls, token_start: int, block_tables: torch.Tensor, lengths: torch.Tensor, num_kv_heads: int,
             num_blocks: int, block_size: int) -> "DecodeGroup":
        """The group of block tables [N, max_blocks] (long) and context lengths [N], both on the device,
        over a cache of `num_kv_heads` heads and `num_blocks` blocks."""
        width = block_tables.shape[1] * block_size
        pad_mask = torch.arange(width, device=lengths.device)[None, :] >= lengths[:, None]  # [N, width]
        return cls(token_start, block_tables.shape[0], block_rows(block_tables, num_kv_heads, num_blocks),
                   pad_mask[None, :, None, :])


@dataclass
class PagedDecodes:
    """All of a step's `num_tokens` decodes (rows [0, num_tokens)), for the kernel that reads the cache
    through their block tables. The "cpu" kernel takes the step's short prompt chunks too, each token as
    a decode at its own position: then num_tokens counts every row, query_tables names each row's block
    table (a chunk's tokens share their sequence's), and a row left to SDPA has context length 0."""

    num_tokens: int
    block_tables: torch.Tensor  # int32 [N, max_blocks], padded with block 0 (a row per sequence)
    context_lens: torch.Tensor  # int32 [N], this token included
    kernel: str = "triton"  # or "cpu": which attention backend's kernel reads them
    query_tables: torch.Tensor | None = None  # int32 [num_tokens]: each row's block table; None: row i's is i


@dataclass
class PagedPrefills:
    """All of a step's prompt chunks, for the "triton" backend's prefill kernel: chunk c has
    num_tokens[c] query rows from row token_starts[c], after num_cached[c] tokens in the cache, and its
    context's blocks in row c of block_tables. The vectors are int32 [C] on the device."""

    block_tables: torch.Tensor  # int32 [C, max_blocks], padded with block 0
    token_starts: torch.Tensor
    num_tokens: torch.Tensor
    num_cached: torch.Tensor
    longest_chunk: int  # the largest of num_tokens, known on the host: it sizes the kernel's grid


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    block_size: int
    decodes: list[DecodeGroup]
    prefills: list[PrefillSpan]
    paged_decodes: PagedDecodes | None = None  # instead of `decodes`, with the "triton" or "cpu" backend
    paged_prefills: PagedPrefills | None = None  # instead of `prefills`, with the "triton" backend


PAGED_KERNELS = ("triton", "cpu")  # the backends whose decodes are PagedDecodes

# The "cpu" kernel takes a prompt chunk while its query heads times its context squared is at most this.
# Each of its tokens is then a decode: that saves SDPA's cost per call, which is what a short prompt pays,
# but its work grows with the context faster than SDPA's (benchmarks/prompt_attention.py measures where
# the two cross: about 128 tokens at 8 query heads, 64 at 32, on CPUs with AVX-512).
PROMPT_KERNEL_WORK = 8 * 128 ** 2
# On a CPU with AVX2 and no AVX-512, torch's SDPA is the slower of the two for longer: they crossed at
# about 512 tokens at 8 query heads and 1,024 at 32 there, so the kernel takes every chunk whose context
# is at most this, whatever its heads.
LONGEST_KERNEL_PROMPT_AVX2 = 512


def longest_kernel_prompt(num_heads: int, avx2_only: bool = False, prompt_kernel: bool = False) -> int | None:
    """The longest context (cached and new tokens) of a prompt chunk that the "cpu" attention kernel
    takes, for a layer of `num_heads` query heads; longer chunks take SDPA. None: every chunk, where the
    kernel has a prompt kernel for the layer's head size (`prompt_kernel`: NativeKernels.takes_prompt),
    which takes the long ones in the same call. `avx2_only`: the CPU has AVX2 and no AVX-512 (where the
    fused kernels multiply in panels: NativeKernels.panel_products)."""
    if prompt_kernel:
        return None
    if avx2_only:
        return LONGEST_KERNEL_PROMPT_AVX2
    return math.isqrt(PROMPT_KERNEL_WORK // max(1, num_heads))


def choose_attention_backend(requested: str, device_type: str, cpu_kernels: bool = False) -> str:
    """"auto", "torch", "triton" or "cpu" -> the backend to use. "auto": Triton's kernel on CUDA where
    Triton is installed (torch's CUDA builds ship it), the C++ kernel on a CPU where `cpu_kernels` (the
    fused CPU kernels are in use), else torch. Triton on a CPU runs only in its interpreter, which the
    tests use to check the kernel."""
    has_triton = importlib.util.find_spec("triton") is not None
    if requested == "auto":
        if device_type == "cuda":
            return "triton" if has_triton else "torch"
        return "cpu" if cpu_kernels else "torch"
    if requested == "cpu" and (device_type != "cpu" or not cpu_kernels):
        raise ValueError("attention backend 'cpu' is the fused C++ kernel for a CPU device: it needs "
                         "EngineConfig.device 'cpu' and the CPU kernels (EngineConfig.cpu_kernels)")
    if requested == "triton" and not has_triton:
        raise ValueError("attention backend 'triton' needs the triton package (pip install triton)")
    if requested == "triton" and device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention backend 'triton' runs on a CPU only under Triton's interpreter "
                         "(TRITON_INTERPRET=1), which is for tests; use 'torch' or 'auto' on a CPU")
    return requested


def block_rows(block_tables: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """The rows of `gather_blocks`' 2-D cache view ([KVH * num_blocks, block_size * Dh]) that hold
    the blocks of `block_tables` [..., nb], every head's in turn: [KVH * prod(shape)]."""
    heads = torch.arange(num_kv_heads, device=block_tables.device).view(-1, *([1] * block_tables.dim()))
    return (heads * num_blocks + block_tables).reshape(-1)


def gather_blocks(cache: torch.Tensor, rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """cache [KVH, slots, Dh] -> [KVH, rows / KVH * block_size, Dh]: the blocks named by `rows`.

    One index_select of whole blocks over a 2-D view copies rows with memcpy: on a CPU about 4x
    faster than advanced indexing of the same blocks."""
    num_kv_heads, num_slots, head_dim = cache.shape
    blocks = cache.view(num_slots // block_size * num_kv_heads, block_size * head_dim).index_select(0, rows)
    return blocks.view(num_kv_heads, -1, head_dim)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, Dh]; k, v [T, KVH, Dh] for this step's tokens (already written to the cache).
    Returns [T, H * Dh]. Rows past the slot mapping's (the model's padding rows) come out zero."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
    if num_tokens > meta.slot_mapping.shape[0]:
        out[meta.slot_mapping.shape[0]:].zero_()
    decodes = meta.paged_decodes
    if decodes is not None and decodes.kernel == "cpu":
        native_kernels().paged_decode_attention(q[: decodes.num_tokens], k_cache, v_cache, decodes.block_tables,
                                                decodes.context_lens, meta.block_size, scale, out[: decodes.num_tokens],
                                                decodes.query_tables)
    elif decodes is not None:
        # Imported here: triton is optional, and only this backend needs it.
        from llmq.model.triton_attention import paged_decode_attention

        paged_decode_attention(q[: decodes.num_tokens], k_cache, v_cache, decodes.block_tables, decodes.context_lens,
                               meta.block_size, scale, out[: decodes.num_tokens])
    for group in meta.decodes:
        rows = slice(group.token_start, group.token_start + group.num_tokens)
        n = group.num_tokens
        keys = gather_blocks(k_cache, group.cache_rows, meta.block_size).view(k_cache.shape[0], n, -1, head_dim)
        values = gather_blocks(v_cache, group.cache_rows, meta.block_size).view(v_cache.shape[0], n, -1, head_dim)
        out[rows] = _decode_attention(q[rows], keys, values, group.pad_mask, scale)
    if meta.paged_prefills is not None:
        from llmq.model.triton_attention import paged_prefill_attention

        chunks = meta.paged_prefills
        paged_prefill_attention(q, k_cache, v_cache, chunks.block_tables, chunks.token_starts, chunks.num_tokens,
                                chunks.num_cached, chunks.longest_chunk, meta.block_size, scale, out)
    for span in meta.prefills:
        rows = slice(span.token_start, span.token_start + span.num_tokens)
        if span.context_rows is None:  # a fresh prompt: its own K/V are the whole context
            keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)  # [KVH, n, Dh]
        else:
            context = span.num_cached + span.num_tokens
            keys = gather_blocks(k_cache, span.context_rows, meta.block_size)[:, :context]  # [KVH, ctx, Dh]
            values = gather_blocks(v_cache, span.context_rows, meta.block_size)[:, :context]
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
