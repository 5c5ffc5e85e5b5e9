"""The service vs the offline engine, on the shared bench workload, in one run.

    python benchmarks/service_throughput.py

Starts the whole service on this machine (a private Redis, SQLite, one Celery worker with the
bench-42m model, the web server) and runs the 64 requests of ../shared/bench/README.md three ways:
  offline   LLMEngine in this process (the reference)
  batch     one OpenAI batch file through HTTP -> Redis -> Celery -> the engine -> SQLite
  streams   64 requests through POST /v1/requests, each followed by its own SSE client
Prints useful tokens/s for each and the ratio to offline, and for the streams the latency from the
engine's step (the time stamped on each token event when the step returns) to the SSE client
receiving it: p50 / p90 / p99. Each service run is repeated (--repeats) and the best is compared,
as in engine_throughput.py.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.local_stack import LocalStack  # noqa: E402
from benchmarks.engine_throughput import bench_model_dir, run_llmq, workload  # noqa: E402

MODEL = "bench-42m"


def run_batch(client: httpx.Client, requests) -> float:
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                  "ignore_eos": True}})
             for i, (prompt, max_tokens) in enumerate(requests)]
    file_id = client.post("/v1/files", files={"file": ("bench.jsonl", "\n".join(lines).encode())},
                          data={"purpose": "batch"}).json()["id"]
    started = time.perf_counter()
    batch = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                             "completion_window": "24h"}).json()
    while batch["status"] not in ("completed", "failed", "cancelled"):
        time.sleep(0.05)
        batch = client.get(f"/v1/batches/{batch['id']}").json()
    seconds = time.perf_counter() - started
    counts = batch["request_counts"]
    if batch["status"] != "completed" or counts["completed"] != len(requests):
        raise SystemExit(f"the bench batch did not complete: {batch}")
    return seconds


def run_streams(base_url: str, requests) -> tuple[float, list[float]]:
    """Every request submitted with POST /v1/requests and followed by its own SSE client on
    /v1/requests/{id}/events; returns (seconds, per-token latencies in s: client receipt minus the
    time the worker stamped on the event when the engine step returned)."""
    latencies: list[float] = []
    lock = threading.Lock()
    errors = []

    def one(prompt, max_tokens) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        mine, tokens = [], 0
        try:
            with httpx.Client(base_url=base_url, timeout=600) as client:
                request_id = client.post("/v1/requests", json=body).json()["id"]
                with client.stream("GET", f"/v1/requests/{request_id}/events") as response:
                    for line in response.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        received = time.time()
                        event = json.loads(line[6:])
                        if event["type"] == "delta":
                            tokens += len(event["token_ids"])
                            mine.append(received - event["t"])
            if tokens != max_tokens:
                raise RuntimeError(f"got {tokens} tokens, asked for {max_tokens}")
        except Exception as err:  # reported below; a benchmark must not hide a failure
            errors.append(err)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=one, args=(p, o)) for p, o in requests]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    if errors:
        raise SystemExit(f"{len(errors)} streaming clients failed, first: {errors[0]!r}")
    return seconds, latencies


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for the service processes (repeatable)")
    args = parser.parse_args()
    folder = bench_model_dir()
    requests = workload()
    useful = sum(o for _, o in requests)

    offline = min(run_llmq(folder, requests, args.repeats)["times"])
    print(f"offline engine: {useful / offline:.1f} useful tokens/s", flush=True)

    with tempfile.TemporaryDirectory() as home:
        env = {"LLMQ_HOME": home, "DATABASE_URL": f"sqlite:///{home}/llmq.db", "MODEL_PATH": str(folder),
               "MODEL_NAME": MODEL, "LLMQ_MAX_NUM_SEQS": "128", "LLMQ_WORKER_THREADS": "160",
               **dict(item.split("=", 1) for item in args.worker_env)}
        # The web server runs as its own process (as the Procfile runs it), not beside the clients.
        with LocalStack(env, start_redis=True, log_dir=Path(home), web="gunicorn") as stack:
            with httpx.Client(base_url=stack.base_url, timeout=600) as client:
                batch_times = [run_batch(client, requests) for _ in range(args.repeats)]
            print("batch through the service: " + ", ".join(f"{useful / t:.1f}" for t in batch_times)
                  + " useful tokens/s", flush=True)
            stream_runs = [run_streams(stack.base_url, requests) for _ in range(args.repeats)]
            print("streaming clients: " + ", ".join(f"{useful / t:.1f}" for t, _ in stream_runs)
                  + " useful tokens/s", flush=True)

    batch_best = min(batch_times)
    stream_best, latencies = min(stream_runs, key=lambda run: run[0])
    latencies_ms = [1000 * x for x in latencies]
    print("\n| path | useful tokens/s | vs offline |\n|---|---|---|")
    for name, seconds in (("offline engine", offline), ("batch via HTTP + Redis + Celery", batch_best),
                          ("64 requests + 64 SSE clients", stream_best)):
        print(f"| {name} | {useful / seconds:.1f} | {offline / seconds:.0%} |")
    print(f"\nstep -> SSE client latency over {len(latencies_ms)} token events: "
          f"p50 {percentile(latencies_ms, 50):.2f} ms, p90 {percentile(latencies_ms, 90):.2f} ms, "
          f"p99 {percentile(latencies_ms, 99):.2f} ms")
    print(json.dumps({"useful_tokens": useful, "offline_s": offline, "batch_s": batch_times,
                      "streams_s": [t for t, _ in stream_runs], "latency_ms_p50": percentile(latencies_ms, 50),
                      "latency_ms_p99": percentile(latencies_ms, 99)}))


if __name__ == "__main__":
    main()
