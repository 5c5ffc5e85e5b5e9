"""The next layer's keys and values asked for during a layer's MLP (csrc/paged_prefetch.h, KvWarmup): every
line decode attention will read, each once, in attention's order, cut into contiguous shares of about
equal lines, each share spread over the steps it is given; and a decoder layer told the next layer's
caches computes what it computes without them."""
from __future__ import annotations

import random

import pytest
import torch

import llmq.model.cpu_kernels as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.native_kernels() is None, reason="the CPU kernels did not build here")

KV_HEADS, HEAD_DIM, BLOCK_SIZE, SLOTS = 3, 32, 16, 64 * 16


def _ops():
    return cpu_kernels.native_kernels()._ops


def _step(rng: random.Random, queries: int, dtype=torch.bfloat16):
    """Caches [KVH, slots, Dh], each query's block table row (its blocks anywhere, none shared) and its
    context length (some 0: a row attention skips)."""
    caches = [torch.zeros(KV_HEADS, SLOTS, HEAD_DIM, dtype=dtype) for _ in range(2)]
    lens = [rng.choice([0, 1, 15, 16, 17, 40, 90]) for _ in range(queries)]
    most_blocks = max(1, max((n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in lens))
    blocks = list(range(SLOTS // BLOCK_SIZE))
    rng.shuffle(blocks)
    tables = torch.zeros(queries, most_blocks, dtype=torch.int32)
    for q, n in enumerate(lens):
        for b in range((n + BLOCK_SIZE - 1) // BLOCK_SIZE):
            tables[q, b] = blocks.pop()
    return caches, tables, torch.tensor(lens, dtype=torch.int32)


def _attention_lines(caches, tables, lens):
    """Every (cache, byte offset) of the lines decode attention reads, piece by piece: query n, KV head h
    (piece n * KVH + h), each of its blocks in order, its keys' lines and its values'."""
    element = caches[0].element_size()
    block_bytes, head_bytes = BLOCK_SIZE * HEAD_DIM * element, caches[0].stride(0) * element
    pieces = []
    for n, length in enumerate(lens.tolist()):
        for h in range(KV_HEADS):
            lines = []
            for b in range((length + BLOCK_SIZE - 1) // BLOCK_SIZE):
                start = h * head_bytes + int(tables[n, b]) * block_bytes
                lines += [(which, start + offset) for offset in range(0, block_bytes, 64) for which in (0, 1)]
            pieces.append(lines)
    return pieces


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("shares", [1, 2, 3])
def test_the_shares_ask_for_every_line_attention_reads_once_in_its_order(seed, shares):
    rng = random.Random(seed)
    caches, tables, lens = _step(rng, rng.randint(1, 12))
    steps = rng.choice([1, 7, 50, 10_000])
    asked = _ops().kv_warmup_lines(*caches, tables, lens, BLOCK_SIZE, shares, steps)
    pieces = _attention_lines(caches, tables, lens)
    expected = [line for piece in pieces for line in piece]
    got = [(which, offset) for share in asked for _, which, offset in share]
    assert got == expected  # shares in turn: contiguous runs of pieces, in attention's order, nothing twice
    total = len(expected)
    for share in asked:  # within its steps, as many lines at each step but the last, which may ask for fewer
        assert all(step < steps for step, _, _ in share)
        counts = [sum(1 for s, _, _ in share if s == step) for step in range(steps)]
        used = [c for c in counts if c]
        assert counts[:len(used)] == used and len(set(used[:-1])) <= 1 and (not used or used[-1] <= used[0])
    # Shares cut at piece boundaries: each no further from an equal share than one piece's lines.
    largest_piece = max(len(p) for p in pieces)
    for share in asked:
        assert abs(len(share) - total / shares) <= largest_piece


def test_more_shares_than_the_warmup_takes_leave_the_extra_ones_nothing():
    caches, tables, lens = _step(random.Random(3), 10)
    asked = _ops().kv_warmup_lines(*caches, tables, lens, BLOCK_SIZE, 12, 5)
    assert len(asked) == 12 and not any(asked[8:])
    got = [(which, offset) for share in asked for _, which, offset in share]
    assert got == [line for piece in _attention_lines(caches, tables, lens) for line in piece]


def test_no_context_asks_for_nothing():
    caches, tables, _ = _step(random.Random(4), 4)
    asked = _ops().kv_warmup_lines(*caches, tables, torch.zeros(4, dtype=torch.int32), BLOCK_SIZE, 2, 10)
    assert asked == [[], []]
