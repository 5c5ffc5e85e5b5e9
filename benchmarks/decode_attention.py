"""The CPU's decode attention kernel on its own (llmq/model/csrc/, attention backend "cpu").

    python benchmarks/decode_attention.py

For bench-42m's shape (8 heads over 4 KV heads of 64) with 64 sequences of 115 tokens, and the 1.1 B
model's (32 heads over 4) with 32 of 200, in bfloat16 and float32: microseconds per layer's call, with
each sequence's blocks scattered over a large cache (as in a running engine) and with every block the
same one (the cache's reads all from the CPU's caches: the arithmetic's share). The cache lies in huge
pages, as the engine's does (llmq/model/huge_pages.py): in 4 KiB pages each scattered block costs a TLB
miss. Prints which code ran ("amx", "avx512-bf16", "avx512-widened" or "vector"; where it is "amx", the
AVX512-BF16 kernel as well, the matrix units disallowed; where it is either AVX512-BF16 path, the other one
too: csrc/bf16_widening.h) and the KV bytes read per second. 2 threads.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmq.engine.config import EngineConfig  # noqa: E402
from llmq.model.cpu_kernels import native_kernels, native_kernels_failure  # noqa: E402
from llmq.model.huge_pages import huge_page_zeros  # noqa: E402

SHAPES = {"bench-42m": dict(seqs=64, heads=8, kv_heads=4, head_dim=64, context=115),
          "llama-1b": dict(seqs=32, heads=32, kv_heads=4, head_dim=64, context=200)}
BLOCK_SIZE, NUM_BLOCKS, CALLS = EngineConfig.block_size, 20_000, 50  # the engine's default block


def time_call(kernels, dtype, seqs, heads, kv_heads, head_dim, context, scattered: bool) -> float:
    """Best of 3 means over CALLS calls, in seconds."""
    generator = torch.Generator().manual_seed(0)
    k_cache, v_cache = (huge_page_zeros((kv_heads, NUM_BLOCKS * BLOCK_SIZE, head_dim), dtype) for _ in range(2))
    for cache in (k_cache, v_cache):
        cache.copy_(torch.randn(cache.shape, generator=generator))
    per_seq = -(-context // BLOCK_SIZE)
    blocks = torch.randperm(NUM_BLOCKS, generator=generator)[: seqs * per_seq] if scattered else torch.zeros(
        seqs * per_seq, dtype=torch.long)
    tables = blocks.view(seqs, per_seq).to(torch.int32)
    lengths = torch.full((seqs,), context, dtype=torch.int32)
    q = torch.randn(seqs, heads, head_dim, generator=generator).to(dtype)
    out = torch.empty(seqs, heads * head_dim, dtype=dtype)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(CALLS):
            kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths, BLOCK_SIZE, head_dim ** -0.5, out)
        best = min(best, (time.perf_counter() - started) / CALLS)
    return best


def main() -> None:
    torch.set_num_threads(2)
    kernels = native_kernels()
    if kernels is None:
        sys.exit(f"the CPU kernels did not build here: {native_kernels_failure()}")
    print("| shape | dtype | code | scattered blocks, µs | one block, µs | KV read, GB/s (scattered) |")
    print("|---|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        for dtype in (torch.bfloat16, torch.float32):
            path = kernels.decode_attention_path(dtype, shape["head_dim"], shape["heads"] // shape["kv_heads"])
            # Where the matrix units take it, the AVX512-BF16 kernel too (the matrix units disallowed); where
            # that kernel takes it, both of its paths: in the dot products, and widened to float32.
            runs = {"amx": [(True, None), (False, None)], "avx512-bf16": [(True, False), (True, True)],
                    "avx512-widened": [(True, True), (True, False)]}.get(path, [(True, None)])
            for allowed, widened in runs:
                kernels._ops.allow_matrix_units(allowed)
                was_widened = kernels._ops.widen_tiles(widened) if widened is not None else None
                code = kernels.decode_attention_path(dtype, shape["head_dim"], shape["heads"] // shape["kv_heads"])
                scattered = time_call(kernels, dtype, **shape, scattered=True)
                cached = time_call(kernels, dtype, **shape, scattered=False)
                kernels._ops.allow_matrix_units(True)
                if was_widened is not None:
                    kernels._ops.widen_tiles(was_widened)
                kv_bytes = 2 * shape["seqs"] * shape["kv_heads"] * shape["context"] * shape["head_dim"] * dtype.itemsize
                code = code if allowed else f"{code} (matrix units off)"
                print(f"| {name} | {str(dtype).removeprefix('torch.')} | {code} | {scattered * 1e6:.0f} | "
                      f"{cached * 1e6:.0f} | {kv_bytes / scattered / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
