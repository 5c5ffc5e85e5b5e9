"""llmq against transformers' static batching on one device (a CUDA GPU), bfloat16, a 1.1 B Llama-shaped model.

    python benchmarks/gpu_bench.py                      # 256 requests of the shared draw, 1 round each
    python benchmarks/gpu_bench.py --requests 128 --rounds 2
    python benchmarks/gpu_bench.py --device cpu --model bench-42m --dtype float32 --requests 16   # a smoke run

The model is the TinyLlama-shaped Llama of benchmarks/bigger_models.py (random weights, written once
under LLMQ_HOME/bench: nothing is downloaded). The requests are ../shared/bench/README.md's draw
(prompts of 8-128 token ids, 8-128 output tokens, greedy, EOS ignored), more of them than on a CPU so
that the device has a batch worth running. Useful tokens/s = the output tokens asked for / the wall
time from submission to the last result; transformers runs static batches of 16 (left padding, each
batch to its longest request). Run by benchmarks/gpu_check.sh; prints a table and a JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bigger_models import model_1b_dir  # noqa: E402
from benchmarks.engine_throughput import bench_model_dir, fresh_prompts, run_transformers, workload  # noqa: E402
from benchmarks.vs_vllm import run_llmq_once  # noqa: E402
from llmq.engine.config import EngineConfig  # noqa: E402
from llmq.engine.llm import LLMEngine  # noqa: E402


def log(message: str) -> None:
    print(f"[gpu_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16, help="transformers' static batch size")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--model", choices=["llama-1b", "bench-42m"], default="llama-1b")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs: every llmq step eager")
    parser.add_argument("--attention", choices=["auto", "torch", "triton"], default="auto",
                        help="llmq's attention backend for decodes")
    parser.add_argument("--scheduling", choices=["auto", "async", "sync"], default="auto",
                        help="async: llmq schedules step n+1 while the device computes step n (auto: on CUDA)")
    args = parser.parse_args()
    on_cuda = args.device.startswith("cuda")
    if on_cuda and not torch.cuda.is_available():
        raise SystemExit("gpu_bench: torch sees no CUDA device")
    name = torch.cuda.get_device_name(args.device) if on_cuda else "cpu"

    requests = workload(n=args.requests)
    useful = sum(o for _, o in requests)
    folder = model_1b_dir() if args.model == "llama-1b" else bench_model_dir()
    log(f"{name}; {args.model}; {len(requests)} requests, {useful} useful tokens; loading llmq")
    engine = LLMEngine(EngineConfig(model=str(folder), device=args.device, dtype=args.dtype,
                                    enable_prefix_caching=False, max_num_seqs=256, cuda_graphs=not args.eager,
                                    attention_backend=args.attention,
                                    async_scheduling={"auto": None, "async": True, "sync": False}[args.scheduling]))
    runner = engine.model_runner
    path = (f"{runner.attention_backend} attention, {'CUDA graphs' if runner.decode_graphs else 'eager steps'}, "
            f"{'async' if engine.async_scheduling else 'plain'} scheduling")
    log(f"llmq: {path}")
    run_llmq_once(engine, fresh_prompts(requests[:16], 10_000), "warm")
    llmq_rates = []
    for r in range(args.rounds):
        llmq_rates.append(useful / run_llmq_once(engine, fresh_prompts(requests, r + 1), f"r{r}"))
        log(f"llmq round {r + 1}: {llmq_rates[-1]:.0f} useful tok/s")
    engine.close()
    del engine
    if on_cuda:
        torch.cuda.empty_cache()

    log(f"transformers, static batch {args.batch}")
    dtype = getattr(torch, args.dtype)
    run_transformers(folder, requests[:args.batch], args.batch, 1, args.device, dtype)  # warm-up
    hf_rates = [useful / s for s in run_transformers(folder, requests, args.batch, args.rounds, args.device, dtype)]
    llmq, hf = statistics.median(llmq_rates), statistics.median(hf_rates)
    print(f"| system ({name}, {args.dtype}, {args.model}) | useful tok/s |\n|---|---|")
    print(f"| llmq ({path}) | {llmq:.0f} |\n| transformers, static batch {args.batch} | {hf:.0f} |")
    print(f"llmq / transformers: {llmq / hf:.1f}x")
    print(json.dumps({"benchmark": "gpu_bench", "device": name, "model": args.model, "llmq_path": path,
                      "requests": len(requests), "useful_tokens": useful, "llmq_tok_s": llmq_rates,
                      "transformers_tok_s": hf_rates, "ratio": llmq / hf}))


if __name__ == "__main__":
    main()
