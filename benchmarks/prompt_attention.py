"""A fresh prompt's attention three ways: SDPA, the CPU's paged kernel taking each token as a decode, and
the CPU's prompt kernel (its tokens in tiles, as small matrix products).

    python benchmarks/prompt_attention.py

With the `cpu` attention backend, where this CPU's build has a prompt kernel for the dtype (bfloat16 on
the matrix units: csrc/prompt_attention_amx.h; every dtype on AVX2 CPUs without AVX-512:
csrc/prompt_attention.h), every prompt chunk goes to the paged kernel's call, which gives the prompt
kernel the chunks of at least 8 tokens (on the matrix units), or those over 128 tokens of context (a
fresh prompt's, and after a cached prefix those of enough tokens: csrc/prompt_attention.h); elsewhere a
chunk goes to the paged kernel
while its query heads times its context squared is at most llmq/model/attention.py's PROMPT_KERNEL_WORK,
and to SDPA otherwise. This prints, for one prompt of each length at bench-42m's heads (8 over 4 KV heads of 64)
and the 1.1 B model's (32 over 4), the milliseconds of one layer's attention each way, in bfloat16 and
float32, and which way the engine takes it. The paged kernel saves a call's cost, which is what a short
prompt pays, and keeps the step's layers in one C++ call each (cpu_kernels.cpp's decoder_layer); its work
grows with the context faster than the other two's. Each engine call to SDPA or the prompt kernel also pays
some Python around it, which this leaves out. 2 threads; best of 3.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmq.model.attention import longest_kernel_prompt  # noqa: E402
from llmq.model.cpu_kernels import native_kernels, native_kernels_failure  # noqa: E402

SHAPES = {"bench-42m": (8, 4, 64), "llama-1b": (32, 4, 64)}
LENGTHS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)
# A fresh prompt of more tokens than this goes to the prompt kernel within the paged call, where this build
# has one: on the matrix units from 8 tokens (csrc/prompt_attention_amx.h's kLeastTokens), on an AVX2 CPU
# past 128 (csrc/prompt_attention.h's kLongestDecodedContext).
PROMPT_KERNEL_PAST = {"amx": 7, "avx2": 128}
BLOCK_SIZE = 8


def best_of_3(run) -> float:
    run()
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def one_prompt(kernels, heads: int, kv_heads: int, head_dim: int, length: int, dtype: torch.dtype):
    """(SDPA seconds, paged kernel seconds, prompt kernel seconds or None where not built) for a fresh
    prompt of `length` tokens."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(length, heads, head_dim, generator=generator).to(dtype)
    k, v = (torch.randn(length, kv_heads, head_dim, generator=generator).to(dtype) for _ in range(2))
    blocks = -(-length // BLOCK_SIZE)
    k_cache, v_cache = (torch.zeros(kv_heads, blocks * BLOCK_SIZE, head_dim, dtype=dtype) for _ in range(2))
    k_cache[:, :length], v_cache[:, :length] = k.transpose(0, 1), v.transpose(0, 1)
    # A row of the block table for each token, rather than query tables naming one shared row: each token
    # as a decode, which the paged call would otherwise give the prompt kernel past its threshold. (Each
    # token then also asks for its context ahead of it, which a chunk's tokens after the first do not: the
    # longer prompts' figures in this column run above what a chunk's tokens as decodes used to cost.)
    tables = torch.arange(blocks, dtype=torch.int32)[None].expand(length, -1).contiguous()
    lengths = torch.arange(1, length + 1, dtype=torch.int32)
    out = torch.empty(length, heads * head_dim, dtype=dtype)
    scale = head_dim ** -0.5

    def sdpa():
        F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       is_causal=True, scale=scale, enable_gqa=True)

    def kernel():
        kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths, BLOCK_SIZE, scale, out)

    def prompt_kernel():
        kernels.prompt_attention(q, k.transpose(0, 1), v.transpose(0, 1), 0, scale)

    tiled = best_of_3(prompt_kernel) if kernels.takes_prompt(head_dim, dtype) else None
    return best_of_3(sdpa), best_of_3(kernel), tiled


def main() -> None:
    torch.set_num_threads(2)
    kernels = native_kernels()
    if kernels is None:
        sys.exit(f"the CPU kernels did not build here: {native_kernels_failure()}")
    print("| shape | dtype | prompt tokens | SDPA, ms | paged kernel, ms | prompt kernel, ms | paged / SDPA | "
          "prompt / SDPA | the engine takes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (heads, kv_heads, head_dim) in SHAPES.items():
        for dtype in (torch.bfloat16, torch.float32):
            prompt_kernel = kernels.takes_prompt(head_dim, dtype)
            longest = longest_kernel_prompt(heads, kernels.panel_products == "avx2", prompt_kernel)
            past = PROMPT_KERNEL_PAST["amx" if prompt_kernel and kernels.panel_products != "avx2" else "avx2"]
            for length in LENGTHS:
                sdpa, kernel, tiled = one_prompt(kernels, heads, kv_heads, head_dim, length, dtype)
                if longest is None:  # every chunk the paged call's, which gives the prompt kernel the long ones
                    takes = "prompt kernel" if length > past else "paged kernel"
                else:
                    takes = "paged kernel" if length <= longest else "SDPA"
                tiled_ms, tiled_ratio = ("-", "-") if tiled is None else (f"{tiled * 1e3:.2f}", f"{tiled / sdpa:.2f}")
                print(f"| {name} | {str(dtype).removeprefix('torch.')} | {length} | {sdpa * 1e3:.2f} | "
                      f"{kernel * 1e3:.2f} | {tiled_ms} | {kernel / sdpa:.2f} | {tiled_ratio} | {takes} |", flush=True)


if __name__ == "__main__":
    main()
