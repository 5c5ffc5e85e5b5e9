"""vLLM's side of benchmarks/vs_vllm.py. Runs under the python of vLLM's own venv; imports no llmq.

    VLLM_CPU_KVCACHE_SPACE=4 DIR/bin/python benchmarks/vllm_worker.py --model FOLDER --dtype bfloat16

Starts one vLLM engine (prefix caching off), prints a ready line, then for each JSON line on stdin,
{"requests": [[prompt_token_ids, max_tokens], ...]}, runs them all through one LLM.generate (greedy,
EOS ignored) and prints {"seconds": wall time of that call, "tokens": [output tokens per request]}.
Its own lines start with MARKER, so vLLM's logging on the same stdout is told apart.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

MARKER = "@@vllm-worker "


def emit(obj: dict) -> None:
    print(MARKER + json.dumps(obj), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--max-num-seqs", type=int, required=True)
    parser.add_argument("--max-num-batched-tokens", type=int, required=True)
    parser.add_argument("--skip-tokenizer", action="store_true",
                        help="skip_tokenizer_init (no detokenizing); by default vLLM detokenizes, as llmq does")
    args = parser.parse_args()

    import vllm
    from vllm import LLM, SamplingParams

    loading = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False, seed=0,
              skip_tokenizer_init=args.skip_tokenizer, disable_log_stats=True)
    emit({"ready": True, "vllm": vllm.__version__, "load_s": time.perf_counter() - loading})
    for line in sys.stdin:
        if not line.strip():
            continue
        requests = json.loads(line)["requests"]
        prompts = [{"prompt_token_ids": prompt} for prompt, _ in requests]
        params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                 detokenize=not args.skip_tokenizer) for _, max_tokens in requests]
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        emit({"seconds": seconds, "tokens": [len(o.outputs[0].token_ids) for o in outputs]})


if __name__ == "__main__":
    main()
