"""Each matrix product of a model's step, timed in every layout llmq can multiply it in here.

    python benchmarks/product_shapes.py                          # bench-42m's shapes, float32
    python benchmarks/product_shapes.py --dtype bfloat16 --rows 1 8 64
    python benchmarks/product_shapes.py --model llama-1b

For each row count and each of the model's products (qkv, o, gate/up, down, the LM head), the best of a
few calls of: F.linear over the dense weight (torch's own product), oneDNN's over its prepacked weight,
and, where the fused CPU kernels have them here, panel_linear (float32 on AVX2 or AVX-512, bfloat16 on an
AVX2 CPU without AVX-512: NativeKernels.panel_dtypes) and tiled_linear (bfloat16 on a CPU with
AVX512-BF16). For the LM head in tiles or panels, also what a greedy step takes from it: the product then
argmax_rows over it ("tiles + argmax", "panels + argmax"), against tiled_argmax or panel_argmax, which
keep each row's argmax without storing the logits. Each layer's product runs over
8 copies of its weight, as a step's 8 layers do, so that the weights are read from memory, not from the
caches. Prints microseconds per product and GFLOP/s; a layout this CPU lacks is left out.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bigger_models import MODEL_1B_CONFIG  # noqa: E402
from benchmarks.engine_throughput import BENCH_CONFIG  # noqa: E402
from llmq.model.cpu_kernels import fast_argmax, native_kernels, panel_argmax, tiled_argmax  # noqa: E402
from llmq.model.cpu_prepack import (ROWS_HINT, panel_weight, panels_fit, prepack_supported, tile_weight,  # noqa: E402
                                    tiles_fit)
from llmq.model.llama import linear  # noqa: E402

MODELS = {"bench-42m": BENCH_CONFIG, "llama-1b": MODEL_1B_CONFIG}


def product_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """name -> (inputs K, outputs N) of each product of a Llama step."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    qkv = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * head_dim
    return {"qkv": (hidden, qkv), "o": (hidden, hidden), "gate_up": (hidden, 2 * inter), "down": (inter, hidden),
            "lm_head": (hidden, config["vocab_size"])}


def torch_multiplies_natively(dtype: torch.dtype) -> bool:
    """Whether torch's own product (F.linear over the dense weight) runs on this CPU's instructions for
    `dtype`; else it is emulated, far slower than anything llmq would run (bfloat16 on an AVX2 CPU)."""
    return dtype == torch.float32 or prepack_supported(dtype)


def layouts(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every layout this CPU multiplies `weight` [N, K] in, by name; llama.py's `linear` runs each
    ("F.linear": the dense weight itself)."""
    out = {"F.linear": weight}
    if prepack_supported(weight.dtype):
        out["oneDNN"] = torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT)
    kernels = native_kernels()
    if kernels is not None and weight.dtype in kernels.panel_dtypes and panels_fit(weight):
        out["panels"] = panel_weight(weight)
    if kernels is not None and kernels.tiled_products and tiles_fit(weight):
        out["tiles"] = tile_weight(weight)
    return out


# What a greedy step takes from an LM head in tiles or panels, by column name: (the layout, each row's
# argmax taken from it), two ways each.
GREEDY_HEADS = {"tiles + argmax": ("tiles", lambda x, w, bias: fast_argmax(linear(x, w, bias))),
                "tiled_argmax": ("tiles", lambda x, w, bias: tiled_argmax(x, w)),
                "panels + argmax": ("panels", lambda x, w, bias: fast_argmax(linear(x, w, bias))),
                "panel_argmax": ("panels", lambda x, w, bias: panel_argmax(x, w))}


def best_seconds(x: torch.Tensor, weights: list[torch.Tensor], repeats: int, product=linear) -> float:
    """The best time over `repeats` of one pass of `product` over every copy, per copy."""
    for w in weights:
        product(x, w, None)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for w in weights:
            product(x, w, None)
        best = min(best, (time.perf_counter() - started) / len(weights))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="bench-42m")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 2048])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    shapes = product_shapes(MODELS[args.model])
    print(f"{args.model} products, {args.dtype}, {args.threads} threads: microseconds per product (GFLOP/s)")
    for name, (k, n) in shapes.items():
        copies = 1 if name == "lm_head" else 8
        dense = [torch.randn(n, k, generator=generator).to(dtype) for _ in range(copies)]
        packed = [layouts(w) for w in dense]
        names = list(packed[0])
        if name == "lm_head":
            names += [head for head, (layout, _) in GREEDY_HEADS.items() if layout in names]
        print(f"\n### {name}: [rows x {k}] x [{k} x {n}]\n| rows | " + " | ".join(names) + " |")
        print("|---" * (len(names) + 1) + "|")
        for rows in args.rows:
            x = torch.randn(rows, k, generator=generator).to(dtype)
            cells = []
            for layout in names:
                if layout == "F.linear" and not torch_multiplies_natively(dtype):
                    cells.append("(emulated: skipped)")
                    continue
                stored, product = GREEDY_HEADS.get(layout, (layout, linear))
                weights = [p[stored] for p in packed]
                seconds = best_seconds(x, weights, 2 if rows > 256 else args.repeats, product)
                cells.append(f"{seconds * 1e6:,.0f} ({2 * rows * k * n / seconds / 1e9:.0f})")
            print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
