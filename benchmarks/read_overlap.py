"""How far this machine overlaps reading memory with arithmetic: the two costs of a decode step, in a loop
of nothing else.

    python benchmarks/read_overlap.py
    python benchmarks/read_overlap.py --rows 1,8,16,32 --megabytes 2048 --threads 2

A decode step of a model too big for the caches reads every weight once from memory and multiplies each
by every sequence's inputs. Its floor in benchmarks/vs_vllm.py's limit is the longer of the two, as if
they overlapped in full. This measures how near a loop comes to that (benchmarks/read_overlap.cpp, built
on first use): it reads a buffer far bigger than the caches once, 64 bytes (16 bfloat16 pairs) at a
time, asking for the line `--prefetch` bytes ahead into L2 as llmq's products do, and multiplies each 64
bytes into `rows` rows' float32 sums (two fused multiply-adds a row, on the pairs widened to float32, as
llmq's tiled products run where the CPU's bfloat16 dot products are slow). The same loop runs with no
arithmetic (the read alone) and over a buffer that fits in L1, read over and over for as many bytes (the
arithmetic alone). For each row count it prints the three times, the loop's share of the floor (the
longer alone over both together: 100 % is a full overlap) and how much of the shorter one was hidden.
No llmq kernel is in the loop: it shows what this machine allows, apart from any kernel's own costs.

Each time is the best of --repeats runs. Time on a 2-core machine: about 15 seconds after the build
(about 25 seconds, once). Tables to stdout, a JSON summary as the last line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmq.model.huge_pages import huge_page_zeros  # noqa: E402

SOURCE = Path(__file__).resolve().with_name("read_overlap.cpp")
LINE = 64
L1_BYTES_PER_THREAD = 32 * 1024  # under any x86 core's L1 data cache


# ---- the arithmetic (pure; tests/test_read_overlap.py) ------------------------------------------

def floor_share(read_s: float, arithmetic_s: float, both_s: float) -> float:
    """The floor a full overlap would give (the longer alone) over the time both together took."""
    return max(read_s, arithmetic_s) / both_s


def hidden_share(read_s: float, arithmetic_s: float, both_s: float) -> float:
    """How much of the shorter cost ran under the longer: 1 where both took the longer one's time alone, 0
    where they took the sum of the two."""
    return (read_s + arithmetic_s - both_s) / min(read_s, arithmetic_s)


def row_flops(rows: int, nbytes: int) -> int:
    """FLOPs of the loop over `nbytes`: each 64 bytes hold 32 weights, each multiplied into every row."""
    return 2 * rows * (nbytes // LINE) * 32


# ---- the loop ------------------------------------------------------------------------------

def build():
    from torch.utils.cpp_extension import load  # imported here: it pulls in setuptools

    return load(name="llmq_read_overlap", sources=[str(SOURCE)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False)


def best_seconds(run, repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def measure(module, rows: int, big: torch.Tensor, small: torch.Tensor, threads: int, prefetch: int,
            repeats: int) -> dict:
    """The three times of one row count, and the loop's shares."""
    x = torch.randn(rows, 2)
    none = torch.empty(0, 2)
    passes = big.numel() // small.numel()
    read = best_seconds(lambda: module.stream_rows(big, none, 1, prefetch, threads), repeats)
    arithmetic = best_seconds(lambda: module.stream_rows(small, x, passes, 0, threads), repeats)
    both = best_seconds(lambda: module.stream_rows(big, x, 1, prefetch, threads), repeats)
    return {"rows": rows, "read_s": read, "arithmetic_s": arithmetic, "both_s": both,
            "read_gb_s": big.numel() / read / 1e9,
            "arithmetic_gflops": row_flops(rows, small.numel() * passes) / arithmetic / 1e9,
            "floor_share": floor_share(read, arithmetic, both), "hidden_share": hidden_share(read, arithmetic, both)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,12,16,24,32", help="row counts, comma-separated (of 1, 2, 4, "
                        "8, 12, 16, 24, 32)")
    parser.add_argument("--megabytes", type=int, default=1024, help="the buffer read from memory (far bigger "
                        "than the last-level cache)")
    parser.add_argument("--threads", type=int, default=2, help="threads, each reading its own part (as the "
                        "engine's products do)")
    parser.add_argument("--prefetch", type=int, default=32 * 1024, help="bytes ahead asked for into L2 with "
                        "each line (0: none)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    started = time.perf_counter()
    module = build()
    print(f"[read_overlap] loop built in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    per_thread = args.megabytes * 2**20 // args.threads // LINE * LINE
    big = huge_page_zeros((per_thread * args.threads,), torch.uint8)
    big.fill_(0x3F)  # touched before timing; every value a finite bfloat16
    small = torch.full((L1_BYTES_PER_THREAD * args.threads,), 0x3F, dtype=torch.uint8)
    big = big[: big.numel() // small.numel() * small.numel()]  # whole passes of the small buffer

    print(f"| rows | read alone, GB/s | arithmetic alone, GFLOP/s | read, ms | arithmetic, ms | both, ms | "
          f"of the floor (longer alone / both) | shorter hidden |\n|---|---|---|---|---|---|---|---|")
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        r = measure(module, rows, big, small, args.threads, args.prefetch, args.repeats)
        results.append(r)
        print(f"| {rows} | {r['read_gb_s']:.1f} | {r['arithmetic_gflops']:.0f} | {r['read_s'] * 1e3:.1f} | "
              f"{r['arithmetic_s'] * 1e3:.1f} | {r['both_s'] * 1e3:.1f} | {r['floor_share']:.0%} | "
              f"{r['hidden_share']:.0%} |", flush=True)
    print(json.dumps({"megabytes": args.megabytes, "threads": args.threads, "prefetch": args.prefetch,
                      "results": [{k: round(v, 6) if isinstance(v, float) else v for k, v in r.items()}
                                  for r in results]}))


if __name__ == "__main__":
    main()
