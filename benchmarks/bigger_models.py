"""Bigger models on the same hardware: weight-only quantization, tensor and pipeline parallelism.

    python benchmarks/bigger_models.py                      # bench-42m, then the 1.1 B model
    python benchmarks/bigger_models.py --models bench-42m   # one model (quick)
    python benchmarks/bigger_models.py --variants bf16,pp2,pp2-no-micro

Models: bench-42m (../shared/bench/README.md's random Llama) and a TinyLlama-shaped 1.1 B Llama
(random weights, written once under LLMQ_HOME/bench), both run in bfloat16. For each variant it prints
the weight memory (every rank's together), the KV blocks, the useful tokens/s of a greedy workload
(the shared one for bench-42m, a smaller one for 1.1 B), and for parallel variants where a step's time
goes: the communication share (tensor parallelism: time in all-reduce and all-gather over step time)
and the pipeline bubble (time a stage waits for another over step time, averaged over the stages),
with and without micro-batching.

On one host the ranks share its cores (each gets cores / ranks threads), so parallelism cannot be
faster here; what it buys on a GPU machine is memory (each rank holds 1/N of the weights) and, for
tensor parallelism, latency. The figures say what the split costs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_throughput import bench_model_dir, fresh_prompts, workload  # noqa: E402
from llmq.bootstrap import llmq_home  # noqa: E402
from llmq.engine.config import EngineConfig  # noqa: E402
from llmq.engine.llm import LLMEngine  # noqa: E402
from llmq.model.checkpoint import byte_level_tokenizer_json, write_llama_checkpoint  # noqa: E402
from llmq.sampling_params import SamplingParams  # noqa: E402

MODEL_1B_CONFIG = {  # TinyLlama-1.1B's shape
    "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
    "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048, "tie_word_embeddings": False,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}
VARIANTS = {
    "bf16": {},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
    "tp2": {"tensor_parallel_size": 2},
    "tp2-int4": {"tensor_parallel_size": 2, "quantization": "int4"},
    "pp2": {"pipeline_parallel_size": 2},
    "pp2-no-micro": {"pipeline_parallel_size": 2, "pipeline_micro_batches": 1},
}
_MIB = 1 << 20


def model_1b_dir() -> Path:
    folder = llmq_home() / "bench" / "llama-1.1b-random"
    if not (folder / "config.json").is_file():
        print(f"writing the 1.1 B model to {folder} (about 4.4 GB, once) ...", flush=True)
        write_llama_checkpoint(folder, MODEL_1B_CONFIG, seed=0, tokenizer_json=byte_level_tokenizer_json(),
                               tokenizer_config={"add_bos_token": False}, max_shard_bytes=1 << 30)
    return folder


def run_variant(folder: Path, requests, options: dict, kv_cache_bytes: int) -> dict:
    loading = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="bfloat16", kv_cache_bytes=kv_cache_bytes, **options))
    load_seconds = time.perf_counter() - loading
    try:
        runner = engine.model_runner
        _generate(engine, requests[:4], repeat=1)  # warm: the first steps pay one-time costs
        before = runner.parallel_report()
        started = time.perf_counter()
        tokens = _generate(engine, requests, repeat=2)
        seconds = time.perf_counter() - started
        after = runner.parallel_report()
        ranks = [{key: a[key] - b[key] for key in ("step_seconds", "busy_seconds", "comm_seconds")}
                 for a, b in zip(after, before)]
        return {"tok_s": tokens / seconds, "weights_bytes": sum(a["weights_bytes"] for a in after),
                "kv_blocks": engine.block_manager.num_blocks, "load_s": load_seconds,
                "comm_share": sum(r["comm_seconds"] / r["step_seconds"] for r in ranks) / len(ranks),
                "bubble": sum(1 - r["busy_seconds"] / r["step_seconds"] for r in ranks) / len(ranks),
                "budget": runner.budget.describe()}
    finally:
        engine.close()


def _generate(engine: LLMEngine, requests, repeat: int) -> int:
    for i, (prompt, max_tokens) in enumerate(fresh_prompts(requests, repeat)):
        engine.add_request(f"{repeat}-{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(delta.token_ids) for delta in engine.step())
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bench-42m,llama-1.1b")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {"bench-42m": (bench_model_dir, workload(), 256 << 20),
              "llama-1.1b": (model_1b_dir, workload(n=16, pmin=16, pmax=64, omin=16, omax=32), 512 << 20)}
    results = {}
    for name in args.models.split(","):
        make_folder, requests, kv_bytes = models[name]
        folder = make_folder()
        useful = sum(o for _, o in requests)
        print(f"\n{name}: {len(requests)} requests, {useful} output tokens, bfloat16, {args.threads} threads",
              flush=True)
        print("| variant | weights (all ranks) | KV blocks | useful tokens/s | vs bf16 | communication | bubble |\n"
              "|---|---|---|---|---|---|---|", flush=True)
        for variant in args.variants.split(","):
            r = run_variant(folder, requests, VARIANTS[variant], kv_bytes)
            results[f"{name}/{variant}"] = r
            base = results.get(f"{name}/bf16")
            ratio = f"{r['tok_s'] / base['tok_s']:.2f}x" if base else "-"
            split = (f"{r['comm_share']:.0%} | {r['bubble']:.0%}" if variant.startswith(("tp", "pp"))
                     else "- | -")
            print(f"| {variant} | {r['weights_bytes'] / _MIB:.0f} MiB | {r['kv_blocks']} | {r['tok_s']:.1f} | {ratio} "
                  f"| {split} |", flush=True)
    print(json.dumps({k: {key: (round(v, 4) if isinstance(v, float) else v) for key, v in r.items()}
                      for k, r in results.items()}))


if __name__ == "__main__":
    main()
