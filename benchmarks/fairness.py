"""Fair share between tenants, measured: tenant B's small streamed completions, alone and while tenant
A floods the same worker (a large batch plus many-choice API requests), and A's throughput with B
idle and with B at work.

    python benchmarks/fairness.py                  # about 3 minutes on a 2-core machine
    python benchmarks/fairness.py --b-requests 200 --batch-lines 2000 --env LLMQ_TENANT_WEIGHTS=tenant-a=3

It starts its own stack (a private Redis, SQLite, one Celery worker, gunicorn as the Procfile runs it) serving the
stories260k model the tests ship, and two API keys, tenants A and B, of equal weight. Three phases:
1. B alone: B sends --b-requests streamed completions of --b-max-tokens tokens, one after another;
   time to first token (TTFT) is the time from sending to the first text chunk.
2. A alone: A's flood (a --batch-lines batch, and --many-choice requests with n = --n, sent at
   once) runs for --window seconds; A's tokens per second, from the worker's heartbeats, and the
   engine's busy time.
3. Both: the flood again, and B's requests as in 1 while it runs.
The targets (issue 13): B's p99 TTFT under the flood within 3x of B alone; A, with B idle, keeps the
engine busy at least 80% of the time.
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

from stack.local import LocalStack  # noqa: E402

STORIES_MODEL = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "stories260k"
PROMPTS = ["Once upon a time", "The little dog", "Lily wanted to", "One day, Tom", "The sun was", "Mom said",
           "A big red ball", "They went to the park", "The bird sang", "Ben had a toy"]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def b_requests(base_url: str, headers: dict, model: str, count: int, max_tokens: int,
               timelines: list | None = None) -> list[float]:
    """B's streamed completions, one after another: the TTFT of each, in ms. With `timelines`, also
    where each one's time went: (sent, stored, started by a worker, first token) in ms from sending."""
    ttfts = []
    with httpx.Client(base_url=base_url, timeout=300, headers=headers) as client:
        for i in range(count):
            body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                    "temperature": 0, "stream": True}
            started = time.perf_counter()
            first = None
            with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"B's request failed: HTTP {response.status_code} {response.read()[:200]!r}")
                request_id = None
                for line in response.iter_lines():
                    if request_id is None and line.startswith("data: {"):
                        request_id = json.loads(line[6:])["id"]
                    if first is None and line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                        first = time.perf_counter()
            if first is None:
                raise RuntimeError("B's stream ended without a token")
            ttfts.append(1000 * (first - started))
            if timelines is not None:
                row = client.get(f"/v1/requests/{request_id}").json()
                sent = time.time() - (time.perf_counter() - started)
                timelines.append({"ttft": ttfts[-1], **{k: round(1000 * (row[k] - sent)) for k in
                                                        ("created_at", "started_at", "first_token_at") if row[k]}})
    return ttfts


class Flood:
    """A's work: a batch and many-choice API requests sent at once, from threads of their own."""

    def __init__(self, base_url: str, headers: dict, model: str, args):
        self.base_url, self.headers, self.model, self.args = base_url, headers, model, args
        self.errors: list[str] = []
        self.batch_id = None
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=300, headers=self.headers) as client:
            rows = [json.dumps({"custom_id": f"a-{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"model": self.model, "prompt": PROMPTS[i % len(PROMPTS)],
                                         "max_tokens": self.args.a_max_tokens, "temperature": 0, "ignore_eos": True}})
                    for i in range(self.args.batch_lines)]
            file_id = client.post("/v1/files", files={"file": ("flood.jsonl", "\n".join(rows).encode())},
                                  data={"purpose": "batch"}).json()["id"]
            self.batch_id = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                              "completion_window": "24h"}).json()["id"]
        self.threads = [threading.Thread(target=self._many_choice, args=(i,), daemon=True)
                        for i in range(self.args.many_choice)]
        for thread in self.threads:
            thread.start()

    def _many_choice(self, i: int) -> None:
        body = {"model": self.model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": self.args.a_max_tokens,
                "n": self.args.n, "temperature": 1.0, "ignore_eos": True}
        with httpx.Client(base_url=self.base_url, timeout=900, headers=self.headers) as client:
            response = client.post("/v1/completions", json=body)
            if response.status_code != 200:
                self.errors.append(f"HTTP {response.status_code}: {response.text[:200]}")

    def stop(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=300, headers=self.headers) as client:
            client.post(f"/v1/batches/{self.batch_id}/cancel")
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                if client.get(f"/v1/batches/{self.batch_id}").json()["status"] in ("cancelled", "completed"):
                    break
                time.sleep(0.5)
        for thread in self.threads:
            thread.join(timeout=600)


def engine_totals(client: httpx.Client) -> tuple[int, float]:
    """(tokens, busy seconds) the worker's engine has done since it started, from its heartbeat."""
    (worker,) = client.get("/v1/workers").json()["data"]
    return worker["tokens"], worker["busy_seconds"]


def measure_window(client: httpx.Client, seconds: float, heartbeat_s: float) -> tuple[float, float]:
    """(tokens/s, busy fraction) of the engine over `seconds`, from heartbeats `seconds` apart."""
    time.sleep(heartbeat_s * 1.5)
    tokens0, busy0 = engine_totals(client)
    started = time.monotonic()
    time.sleep(seconds)
    tokens1, busy1 = engine_totals(client)
    elapsed = time.monotonic() - started
    return (tokens1 - tokens0) / elapsed, (busy1 - busy0) / elapsed


def main() -> None:
    args = _arguments()
    home = tempfile.mkdtemp(prefix="llmq-fairness-")
    env = {"LLMQ_HOME": home, "DATABASE_URL": f"sqlite:///{home}/llmq.db", "LLMQ_HEARTBEAT_SECONDS": "1",
           "LLMQ_MAX_NUM_SEQS": str(args.max_num_seqs), "MODEL_PATH": str(args.model), **dict(args.env)}
    print(f"starting: Redis, 1 worker, the web server (logs in {home})", flush=True)
    with LocalStack(env, start_redis=True, log_dir=Path(home), web="gunicorn") as stack:
        headers = stack.key_headers("tenant-a", "tenant-b")
        a, b = headers["tenant-a"], headers["tenant-b"]
        with httpx.Client(base_url=stack.base_url, timeout=60, headers=a) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            b_requests(stack.base_url, b, model, 3, args.b_max_tokens)  # warm the path
            print(f"1. B alone: {args.b_requests} requests", flush=True)
            alone = b_requests(stack.base_url, b, model, args.b_requests, args.b_max_tokens)

            print(f"2. A alone: {args.batch_lines}-line batch + {args.many_choice} requests with n={args.n}, "
                  f"{args.window:.0f} s", flush=True)
            flood = Flood(stack.base_url, a, model, args)
            flood.start()
            time.sleep(args.ramp)
            a_alone_tps, a_alone_busy = measure_window(client, args.window, 1.0)
            flood.stop()

            print("3. A floods, B sends its requests", flush=True)
            flood = Flood(stack.base_url, a, model, args)
            flood.start()
            time.sleep(args.ramp)
            tokens0, _ = engine_totals(client)
            started = time.monotonic()
            timelines = []
            under = b_requests(stack.base_url, b, model, args.b_requests, args.b_max_tokens, timelines)
            elapsed = time.monotonic() - started
            time.sleep(1.5)
            tokens1, _ = engine_totals(client)
            b_tokens = args.b_requests * args.b_max_tokens
            a_with_b_tps = (tokens1 - tokens0 - b_tokens) / (elapsed + 1.5)
            batch = client.get(f"/v1/batches/{flood.batch_id}").json()
            flood.stop()
            errors = flood.errors
    ratio = percentile(under, 0.99) / percentile(alone, 0.99)
    slowest = sorted(range(len(under)), key=lambda i: -under[i])[:5]
    print("B's slowest under the flood (ms after sending: stored by the web, started by a worker, first token):")
    for i in slowest:
        print(f"  request {i}: {timelines[i]}")
    rows = [
        ("B alone: TTFT p50 / p99", f"{statistics.median(alone):.0f} / {percentile(alone, 0.99):.0f} ms"),
        ("B under A's flood: TTFT p50 / p99", f"{statistics.median(under):.0f} / {percentile(under, 0.99):.0f} ms"),
        ("B's p99 under the flood / alone (target <= 3)", f"{ratio:.2f}"),
        ("A alone: tokens/s, engine busy", f"{a_alone_tps:.0f}, {100 * a_alone_busy:.0f}% (target >= 80%)"),
        ("A while B sends: tokens/s", f"{a_with_b_tps:.0f} ({100 * a_with_b_tps / a_alone_tps:.0f}% of alone)"),
        ("A's batch lines done when B finished", f"{batch['request_counts']['completed']}/{args.batch_lines}"),
        ("A's many-choice requests failed", str(len(errors))),
    ]
    print(f"\n| fairness ({args.max_num_seqs} slots, B: {args.b_requests} x {args.b_max_tokens} tokens; "
          f"A: {args.batch_lines} lines + {args.many_choice} x n={args.n}, {args.a_max_tokens} tokens) | |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    print(json.dumps({"b_alone_ms": {"p50": statistics.median(alone), "p99": percentile(alone, 0.99)},
                      "b_under_flood_ms": {"p50": statistics.median(under), "p99": percentile(under, 0.99)},
                      "p99_ratio": ratio, "a_alone_tokens_per_s": a_alone_tps, "a_alone_engine_busy": a_alone_busy,
                      "a_with_b_tokens_per_s": a_with_b_tps, "a_errors": errors}))
    if ratio > 3 or a_alone_busy < 0.8 or errors:
        sys.exit(1)


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=STORIES_MODEL)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--b-requests", type=int, default=100)
    parser.add_argument("--b-max-tokens", type=int, default=8)
    parser.add_argument("--batch-lines", type=int, default=600)
    parser.add_argument("--many-choice", type=int, default=8, help="A's API requests, sent at once")
    parser.add_argument("--n", type=int, default=32, help="their samples each")
    parser.add_argument("--a-max-tokens", type=int, default=128)
    parser.add_argument("--window", type=float, default=8.0, help="seconds over which A alone is measured")
    parser.add_argument("--env", action="append", default=[], type=lambda kv: tuple(kv.split("=", 1)),
                        help="NAME=VALUE for the stack's processes (repeatable), e.g. LLMQ_TENANT_WEIGHTS=tenant-a=2")
    parser.add_argument("--ramp", type=float, default=4.0, help="seconds the flood runs before measuring")
    return parser.parse_args()


if __name__ == "__main__":
    main()
