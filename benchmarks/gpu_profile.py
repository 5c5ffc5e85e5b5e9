"""Where llmq's time goes on a GPU: each round of the workload split by step kind, then torch.profiler's
top kernels over one more round.

    python benchmarks/gpu_profile.py                          # 1.1 B, bfloat16, 256 requests, 3 rounds
    python benchmarks/gpu_profile.py --scheduling sync        # without async scheduling
    python benchmarks/gpu_profile.py --device cpu --model bench-42m --dtype float32 --requests 16   # a smoke run

The workload is gpu_bench.py's (../shared/bench/README.md's draw, greedy, EOS ignored). For every round
it prints the wall time and useful tokens/s, the median and slowest step() (with async scheduling a
step's wall time is about the device's time for the step before it), and the host's time launching
each kind of step: prompt chunks (eager) and decode-only steps (replayed from CUDA graphs, or eager).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bigger_models import model_1b_dir  # noqa: E402
from benchmarks.engine_throughput import bench_model_dir, fresh_prompts, workload  # noqa: E402
from benchmarks.vs_vllm import run_llmq_once  # noqa: E402
from llmq.engine.config import EngineConfig  # noqa: E402
from llmq.engine.llm import LLMEngine  # noqa: E402


def timed_steps(engine: LLMEngine) -> tuple[list[tuple[str, int, float]], list[float]]:
    """Wrap the engine's step() and its runner's execute(): (kind, tokens, host seconds) of every
    forward launched, and the wall seconds of every step(), appended as they happen."""
    runner, launches, walls = engine.model_runner, [], []
    execute, step = runner.execute, engine.step

    def timed_execute(steps, previous_tokens=None):
        first = steps[0]
        graphed = runner.decode_graphs is not None and len(steps) == 1 and runner.decode_graphs.accepts(first)
        kind = "decodes, graph" if graphed else ("decodes, eager" if first.is_decode_only else "with prompt chunks")
        started = time.perf_counter()
        logits = execute(steps, previous_tokens)
        launches.append((kind, sum(s.num_tokens for s in steps), time.perf_counter() - started))
        return logits

    def timed_step():
        started = time.perf_counter()
        deltas = step()
        walls.append(time.perf_counter() - started)
        return deltas

    runner.execute, engine.step = timed_execute, timed_step
    return launches, walls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--model", choices=["llama-1b", "bench-42m"], default="llama-1b")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--scheduling", choices=["auto", "async", "sync"], default="auto")
    parser.add_argument("--no-profiler", action="store_true", help="the rounds only")
    args = parser.parse_args()
    on_cuda = args.device.startswith("cuda")
    requests = workload(n=args.requests)
    useful = sum(o for _, o in requests)
    folder = model_1b_dir() if args.model == "llama-1b" else bench_model_dir()
    started = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(folder), device=args.device, dtype=args.dtype,
                                    enable_prefix_caching=False, max_num_seqs=max(args.requests, 1),
                                    async_scheduling={"auto": None, "async": True, "sync": False}[args.scheduling]))
    runner = engine.model_runner
    print(f"{args.model} on {args.device}, {args.dtype}: {runner.attention_backend} attention, "
          f"{'CUDA graphs' if runner.decode_graphs else 'eager steps'}, "
          f"{'async' if engine.async_scheduling else 'plain'} scheduling; loaded in {time.perf_counter() - started:.1f} s")
    run_llmq_once(engine, fresh_prompts(requests[:16], 10_000), "warm")
    launches, walls = timed_steps(engine)
    for r in range(args.rounds):
        launches.clear()
        walls.clear()
        seconds = run_llmq_once(engine, fresh_prompts(requests, r + 1), f"r{r}")
        kinds: dict[str, list] = defaultdict(lambda: [0, 0, 0.0])
        for kind, tokens, host in launches:
            kinds[kind][0] += 1
            kinds[kind][1] += tokens
            kinds[kind][2] += host
        print(f"round {r + 1}: {seconds:.2f} s, {useful / seconds:.0f} useful tok/s; {len(walls)} steps, median "
              f"{statistics.median(walls) * 1e3:.1f} ms, slowest {max(walls) * 1e3:.1f} ms")
        for kind, (count, tokens, host) in kinds.items():
            print(f"  {kind}: {count} steps, {tokens} tokens, host launching them {host * 1e3:.0f} ms")
    if not args.no_profiler:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        with profile(activities=activities) as prof:
            seconds = run_llmq_once(engine, fresh_prompts(requests, args.rounds + 1), "profiled")
        print(f"profiled round: {seconds:.2f} s (the profiler slows the host)")
        sort_by = "self_cuda_time_total" if on_cuda else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort_by, row_limit=20, max_name_column_width=60))
    engine.close()


if __name__ == "__main__":
    main()
