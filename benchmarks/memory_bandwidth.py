"""How fast this machine reads memory, by how much is read: where a step's weights and KV cache stop
fitting in the CPU's last-level cache.

    python benchmarks/memory_bandwidth.py
    python benchmarks/memory_bandwidth.py --sizes 32,64,96,128,256 --threads 2

A decode step reads every weight once (bench-42m: 83 MB in bfloat16; the 1.1 B model: about 2 GB) and
each running sequence's KV cache. While all of that fits in the last-level cache, the reads run at its
speed; past it, at the memory's. This prints read GB/s (a sum over a float32 tensor of each size, read
again and again, best of 3 means) so a step's floor can be set against the right one. 2 threads by
default, as the engine runs.
"""
from __future__ import annotations

import argparse
import time

import torch


def read_rate(megabytes: int, seconds_per_size: float = 1.0) -> float:
    """Bytes per second of repeated sums over a `megabytes` tensor."""
    x = torch.ones(megabytes * 2**20 // 4)
    x.sum()
    started = time.perf_counter()
    x.sum()
    repeats = max(3, int(seconds_per_size / 3 / max(time.perf_counter() - started, 1e-6)))
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(repeats):
            x.sum()
        best = min(best, (time.perf_counter() - started) / repeats)
    return x.numel() * 4 / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="8,32,64,80,96,128,192,512,1024", help="MB, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"| MB read | GB/s ({args.threads} threads) |\n|---|---|")
    for megabytes in (int(s) for s in args.sizes.split(",")):
        print(f"| {megabytes} | {read_rate(megabytes) / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
