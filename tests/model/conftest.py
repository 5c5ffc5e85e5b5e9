"""Helpers shared by the model tests."""
from __future__ import annotations

import contextlib

import torch

from llmq.model.cpu_kernels import native_kernels


def scattered_block_tables(contexts: list[int], block_size: int, generator: torch.Generator,
                           spare: int = 8) -> tuple[torch.Tensor, int]:
    """Block tables (int32 [len(contexts), most blocks]) for sequences of these context lengths, their
    blocks taken in a random order from a cache of `spare` more blocks than they need; and that cache's
    number of blocks."""
    blocks = [-(-length // block_size) for length in contexts]
    order = torch.randperm(sum(blocks) + spare, generator=generator).to(torch.int32)
    tables = torch.zeros(len(contexts), max(blocks), dtype=torch.int32)
    taken = 0
    for row, count in enumerate(blocks):
        tables[row, :count] = order[taken:taken + count]
        taken += count
    return tables, len(order)


@contextlib.contextmanager
def _switched(switch, value):
    """A kernels' switch (an op that sets it and returns what it was) at `value` while inside."""
    before = switch(value)
    try:
        yield
    finally:
        switch(before)


def one_thread_takes_every_run():
    """The fused kernels' work split between threads (work_split.h's runs: the products' column chunks,
    decode attention's pieces) all taken by the calling thread while inside: its own run, then the others'
    from their backs, the order in which a thread done early meets another's work."""
    return _switched(native_kernels()._ops.take_runs_in_one_thread, True)


def bf16_widened(widened: bool):
    """bfloat16 in the CPU's dot products (VDPBF16PS), or widened to float32 for its multiply-adds, while
    inside (csrc/bf16_widening.h: the tiled products' dot-product path and bfloat16 decode attention both
    follow it), whichever this CPU would choose: the tests check both paths on any CPU with AVX512-BF16."""
    return _switched(native_kernels()._ops.widen_tiles, widened)
