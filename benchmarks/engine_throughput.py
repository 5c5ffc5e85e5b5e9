"""Offline throughput: llmq's engine vs transformers static batching, on the shared bench workload.

    python benchmarks/engine_throughput.py              # transformers batch 16 and 64, then llmq
    python benchmarks/engine_throughput.py --skip-hf    # llmq only (quick iterations)

The workload is ../shared/bench/README.md's: "bench-42m" (a random-weight Llama, 41.6 M parameters,
float32), 64 requests from random.Random(0), greedy, every request runs to its own max_tokens.
Everything runs in one process on the same threads, so the ratios hold on a noisy machine.
Prints each system's useful tokens/s, the ratios, MFU against the float32 matmul peak measured in
this run, and llmq's KV memory waste (allocated but unused KV slots / allocated, sampled each step).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmq.bootstrap import llmq_home  # noqa: E402
from llmq.engine.config import EngineConfig  # noqa: E402
from llmq.engine.llm import LLMEngine
from llmq.model.checkpoint import byte_level_tokenizer_json, write_llama_checkpoint  # noqa: E402
from llmq.sampling_params import SamplingParams

BENCH_CONFIG = {
    "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
    "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 1024,
    "tie_word_embeddings": True, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
}


def workload(n=64, seed=0, pmin=8, pmax=128, omin=8, omax=128, vocab=32000):
    """The shared workload, drawn exactly as ../shared/bench/hf_baseline.py draws it."""
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(pmin, pmax))], rng.randint(omin, omax))
            for _ in range(n)]


def fresh_prompts(requests, repeat: int, vocab=32000):
    """The workload for repeat `repeat`: the same lengths, every prompt token id moved by `repeat`
    (within 3..vocab-1). Throughput does not depend on the ids, but prefix caching does: a repeat of
    the very same prompts would find them all cached and skip their prefill, which no real workload
    of fresh prompts gets."""
    return [([3 + (t - 3 + repeat) % (vocab - 3) for t in prompt], max_tokens) for prompt, max_tokens in requests]


def bench_model_dir() -> Path:
    folder = llmq_home() / "bench" / "bench-42m"
    if not (folder / "config.json").is_file():
        print(f"writing the bench model to {folder} ...", flush=True)
        write_llama_checkpoint(folder, BENCH_CONFIG, seed=0, tokenizer_json=byte_level_tokenizer_json(),
                               tokenizer_config={"add_bos_token": False})
    return folder


def matmul_peak_flops(size: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(repeats))
    return 2 * size ** 3 / best


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def run_transformers(folder: Path, requests, batch: int, repeats: int, device: str = "cpu",
                     dtype: torch.dtype = torch.float32) -> list[float]:
    """Seconds for each of `repeats` runs of the whole workload (fresh prompts each time) in static batches."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    times = []
    for repeat in range(repeats):
        started = time.perf_counter()
        with torch.inference_mode():
            for i in range(0, len(requests), batch):
                chunk = fresh_prompts(requests[i:i + batch], repeat)
                longest = max(len(p) for p, _ in chunk)
                new_tokens = max(o for _, o in chunk)
                ids = torch.zeros(len(chunk), longest, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for j, (prompt, _) in enumerate(chunk):  # left padding
                    ids[j, longest - len(prompt):] = torch.tensor(prompt)
                    mask[j, longest - len(prompt):] = 1
                model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        if device != "cpu":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return times


def run_llmq(folder: Path, requests, repeats: int, engine: LLMEngine | None = None, first_repeat: int = 0,
             **engine_options) -> dict:
    """Seconds for each of `repeats` runs of the whole workload (all submitted at once, fresh prompts
    each time: see fresh_prompts) through one engine, with the KV waste sampled after every step."""
    engine = engine or LLMEngine(EngineConfig(model=str(folder), **engine_options))
    times, waste_samples, steps = [], [], 0
    for repeat in range(first_repeat, first_repeat + repeats):
        generated = {}
        started = time.perf_counter()
        for i, (prompt, max_tokens) in enumerate(fresh_prompts(requests, repeat)):
            engine.add_request(f"{repeat}-{i}", {"prompt_token_ids": prompt},
                               SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        while engine.has_unfinished():
            for delta in engine.step():
                generated[delta.request_id] = generated.get(delta.request_id, 0) + len(delta.token_ids)
            used, allocated = engine.scheduler.kv_slot_usage()
            if allocated:
                waste_samples.append(1 - used / allocated)
            steps += 1
        times.append(time.perf_counter() - started)
        if generated != {f"{repeat}-{i}": o for i, (_, o) in enumerate(requests)}:
            raise SystemExit("llmq produced a different number of tokens than requested")
    return {"times": times, "steps": steps // repeats, "kv_waste": sum(waste_samples) / len(waste_samples),
            "kv_waste_max": max(waste_samples), "kv_blocks": engine.block_manager.num_blocks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-hf", action="store_true", help="measure llmq only")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of the workload per system, each with fresh prompts; the best (warm, "
                             "as a long-lived worker is) is compared, every run is printed")
    parser.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens)
    parser.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    folder = bench_model_dir()
    requests = workload()
    useful = sum(o for _, o in requests)
    flops_per_token = 2 * 41.6e6
    peak = matmul_peak_flops()
    print(f"workload: {len(requests)} requests, {useful} output tokens; matmul peak {peak / 1e9:.1f} GFLOP/s "
          f"({args.threads} threads)", flush=True)

    results = {}
    if not args.skip_hf:
        for batch in (16, 64):
            times = run_transformers(folder, requests, batch, args.repeats)
            results[f"transformers static batch {batch}"] = {"times": times}
            print(f"transformers static batch {batch}: " + ", ".join(f"{useful / t:.1f}" for t in times)
                  + " useful tokens/s", flush=True)
    llmq = run_llmq(folder, requests, args.repeats, max_num_seqs=args.max_num_seqs, block_size=args.block_size,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    dtype="float32")  # the workload's, as transformers'
    results["llmq"] = llmq
    print("llmq: " + ", ".join(f"{useful / t:.1f}" for t in llmq["times"])
          + f" useful tokens/s, {llmq['steps']} steps per run", flush=True)
    for r in results.values():
        r["seconds"] = min(r["times"])

    print("\n| system | useful tokens/s | vs transformers b16 | vs b64 | MFU |\n|---|---|---|---|---|")
    for name, r in results.items():
        rate = useful / r["seconds"]
        r["useful_tok_per_s"] = round(rate, 1)
        r["mfu"] = round(rate * flops_per_token / peak, 3)
        ratios = [f"{rate * results[k]['seconds'] / useful:.2f}x" if k in results else "-"
                  for k in ("transformers static batch 16", "transformers static batch 64")]
        print(f"| {name} | {rate:.1f} | {ratios[0]} | {ratios[1]} | {r['mfu']:.0%} |")
    print(f"\nllmq KV memory waste: {llmq['kv_waste']:.2%} mean, {llmq['kv_waste_max']:.2%} max "
          f"(block size {args.block_size})")
    print(json.dumps({"matmul_peak_gflops": round(peak / 1e9, 1), "useful_tokens": useful, **results}))


if __name__ == "__main__":
    main()
