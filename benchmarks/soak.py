"""Load and faults together, from two tenants: tenant "flood" runs a batch job and many-choice
completions, tenant "apps" streams small completions, and a worker is killed and Redis restarted
along the way. Counts what a user would: requests served, errors, time to first token, answers
that were a server error, and the batch's lost and duplicated lines (lost, duplicated and server
errors must all be 0; the script exits 1 otherwise). A 503 with Retry-After while Redis is down is
the documented answer, counted apart, and the client tries again.

    python benchmarks/soak.py                       # about 2 minutes on a 2-core machine
    python benchmarks/soak.py --clients 16 --batch-lines 1000 --kill-at 20 --restart-redis-at 50

It starts its own stack on this machine (a private Redis with its append-only file, SQLite, two
Celery workers, gunicorn), with short fault timeouts so a killed worker's requests are taken over in
seconds rather than after the production visibility timeout of an hour. At --kill-at seconds one
worker is killed with SIGKILL and a fresh one started; at --restart-redis-at Redis is stopped and
started again. Each streaming client submits completions with `stream: true` one after another
until the batch ends; a stream that breaks, returns an error, or whose tokens are not all there
counts as an error.
"""
from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stack.local import LocalStack  # noqa: E402

STORIES_MODEL = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "stories260k"  # the tests ship it
PROMPTS = ["Once upon a time", "The little dog", "Lily wanted to", "One day, Tom", "The sun was", "Mom said",
           "A big red ball", "They went to the park", "The bird sang", "Ben had a toy"]
FAULT_ENV = {"LLMQ_HEARTBEAT_SECONDS": "1", "LLMQ_VISIBILITY_TIMEOUT": "30", "LLMQ_LEASE_SECONDS": "8",
             "LLMQ_SWEEP_SECONDS": "2", "LLMQ_SHUTDOWN_GRACE_SECONDS": "10", "LLMQ_MAX_NUM_SEQS": "32"}


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.served = 0
        self.errors: list[str] = []
        self.ttft: list[float] = []
        self.server_errors: list[str] = []  # 5xx answers, but a 503 that says when to try again
        self.unavailable = 0  # 503 + Retry-After: Redis was away
        self.flood_served = 0

    def status(self, response: httpx.Response) -> bool:
        """Counts a non-200 answer; True when the request should simply be sent again (a 503 with Retry-After)."""
        with self.lock:
            if response.status_code == 503 and "retry-after" in response.headers:
                self.unavailable += 1
                return True
            if response.status_code >= 500:
                self.server_errors.append(f"HTTP {response.status_code}: {response.read()[:200]!r}")
        return False

    def ok(self, ttft: float) -> None:
        with self.lock:
            self.served += 1
            self.ttft.append(ttft)

    def error(self, what: str) -> None:
        with self.lock:
            self.errors.append(what)


def stream_client(base_url: str, headers: dict, model: str, max_tokens: int, stop: threading.Event, tally: Tally,
                  n: int) -> None:
    with httpx.Client(base_url=base_url, timeout=120, headers=headers) as client:
        while not stop.is_set():
            body = {"model": model, "prompt": PROMPTS[n % len(PROMPTS)], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            n += 1
            started, first, tokens = time.perf_counter(), None, 0
            try:
                with client.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        if tally.status(response):
                            time.sleep(1)
                        else:
                            tally.error(f"HTTP {response.status_code}: {response.read()[:200]!r}")
                        continue
                    for line in response.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            raise RuntimeError(chunk["error"])
                        if chunk["choices"] and chunk["choices"][0]["text"]:
                            first = first or time.perf_counter()
                        tokens += 1 if chunk["choices"] else 0
                if first is None:
                    raise RuntimeError("no token came")
                tally.ok(first - started)
            except Exception as err:  # counted, never hidden
                tally.error(repr(err)[:200])


def flood_client(base_url: str, headers: dict, model: str, max_tokens: int, n: int, stop: threading.Event,
                 tally: Tally) -> None:
    """The flooding tenant's many-choice completions, one after another until `stop`."""
    with httpx.Client(base_url=base_url, timeout=600, headers=headers) as client:
        while not stop.is_set():
            body = {"model": model, "prompt": PROMPTS[0], "max_tokens": max_tokens, "n": n, "temperature": 1.0,
                    "ignore_eos": True}
            try:
                response = client.post("/v1/completions", json=body)
            except httpx.HTTPError as err:
                tally.error(f"flood request: {err!r}"[:200])
                continue
            if response.status_code == 200:
                with tally.lock:
                    tally.flood_served += 1
            elif tally.status(response):
                time.sleep(1)
            else:
                tally.error(f"flood request: HTTP {response.status_code}: {response.text[:200]}")


def submit_batch(client: httpx.Client, model: str, lines: int, max_tokens: int) -> str:
    rows = [json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                        "body": {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                                 "temperature": 0, "ignore_eos": True}}) for i in range(lines)]
    file_id = client.post("/v1/files", files={"file": ("soak.jsonl", "\n".join(rows).encode())},
                          data={"purpose": "batch"}).json()["id"]
    return client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                            "completion_window": "24h"}).json()["id"]


def get_json(client: httpx.Client, path: str, tally: Tally | None = None, attempts: int = 30):
    """GET with retries: a poll may land on the moment Redis is down (503, counted in `tally`)."""
    for attempt in range(attempts):
        try:
            response = client.get(path)
            if response.status_code == 200:
                return response
            if tally is not None:
                tally.status(response)
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"GET {path} kept failing")


def main() -> None:
    args = _arguments()
    home = tempfile.mkdtemp(prefix="llmq-soak-")  # kept when the run fails: the logs say why
    env = {"LLMQ_HOME": home, "DATABASE_URL": f"sqlite:///{home}/llmq.db", **FAULT_ENV}
    model_dir = args.model or (STORIES_MODEL if STORIES_MODEL.is_dir() else None)
    if model_dir is not None:
        env["MODEL_PATH"] = str(model_dir)
    print(f"starting: Redis, 2 workers, gunicorn (logs in {home})", flush=True)
    with LocalStack(env, start_redis=True, workers=2, log_dir=Path(home), web="gunicorn") as stack:
        headers = stack.key_headers("flood", "apps")
        with httpx.Client(base_url=stack.base_url, timeout=120, headers=headers["flood"]) as client:
            batch, lines, tally, seconds = _run_with_faults(stack, client, headers, args)
    if not _report(args, Path(home), batch, lines, tally, seconds):
        print(f"FAILED: logs and database kept in {home}")
        sys.exit(1)
    shutil.rmtree(home, ignore_errors=True)


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None,
                        help="model folder (default: the stories260k the tests ship, else llmq's own)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent streaming clients")
    parser.add_argument("--batch-lines", type=int, default=300)
    parser.add_argument("--flood-clients", type=int, default=2,
                        help="the flooding tenant's clients sending many-choice completions")
    parser.add_argument("--flood-n", type=int, default=16, help="their samples per request")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--kill-at", type=float, default=15.0, help="seconds in: SIGKILL a worker")
    parser.add_argument("--restart-redis-at", type=float, default=35.0, help="seconds in: restart Redis")
    parser.add_argument("--timeout", type=float, default=900.0, help="give up on the batch after this")
    return parser.parse_args()


def _run_with_faults(stack: LocalStack, client: httpx.Client, headers: dict,
                     args) -> tuple[dict, list[dict], Tally, float]:
    """The batch and the streaming clients, a worker killed and Redis restarted on the way; returns
    the batch as last polled, its output and error lines, the clients' tally and the seconds taken."""
    model = client.get("/v1/models").json()["data"][0]["id"]
    tally, stop = Tally(), threading.Event()
    started = time.monotonic()
    batch_id = submit_batch(client, model, args.batch_lines, args.max_tokens)
    clients = [threading.Thread(target=stream_client, daemon=True,
                                args=(stack.base_url, headers["apps"], model, args.max_tokens, stop, tally, n))
               for n in range(args.clients)]
    clients += [threading.Thread(target=flood_client, daemon=True,
                                 args=(stack.base_url, headers["flood"], model, args.max_tokens, args.flood_n, stop,
                                       tally))
                for _ in range(args.flood_clients)]
    for thread in clients:
        thread.start()
    faults = sorted([(args.kill_at, "kill"), (args.restart_redis_at, "redis")])
    batch = {}
    while time.monotonic() - started < args.timeout:
        elapsed = time.monotonic() - started
        while faults and elapsed >= faults[0][0]:
            _, fault = faults.pop(0)
            if fault == "kill":
                print(f"{elapsed:5.1f}s  SIGKILL worker w0; starting w2", flush=True)
                stack.kill_worker("w0", signal.SIGKILL)
                stack.start_worker("w2")
            else:
                print(f"{elapsed:5.1f}s  restarting Redis", flush=True)
                stack.restart_redis(down_s=2.0)
        batch = get_json(client, f"/v1/batches/{batch_id}", tally).json()
        counts = batch["request_counts"]
        print(f"{elapsed:5.1f}s  batch {batch['status']}: {counts['completed']}/{counts['total']} done, "
              f"{counts['failed']} failed; streams served {tally.served}, flood requests {tally.flood_served}, "
              f"errors {len(tally.errors)}, server errors {len(tally.server_errors)}", flush=True)
        if batch["status"] in ("completed", "failed", "cancelled", "expired") and not faults:
            break
        time.sleep(2)
    stop.set()
    for thread in clients:
        thread.join(timeout=150)
    seconds = time.monotonic() - started
    lines = []
    for key in ("output_file_id", "error_file_id"):
        if batch.get(key):
            text = get_json(client, f"/v1/files/{batch[key]}/content").text
            lines += [json.loads(line) for line in text.splitlines()]
    return batch, lines, tally, seconds


def _report(args, home: Path, batch: dict, lines: list[dict], tally: Tally, seconds: float) -> bool:
    """Print the soak's table and its JSON; True when no line was lost or doubled and the batch completed."""
    worker_logs = "".join(path.read_text(errors="replace") for path in home.glob("worker-*.log"))
    resumed = worker_logs.count("from its checkpoint")
    handed_over = worker_logs.count("waiting for it to finish or its lease to lapse")
    seen = Counter(line["custom_id"] for line in lines)
    expected = {f"line-{i}" for i in range(args.batch_lines)}
    lost = len(expected - set(seen))
    duplicated = sum(count - 1 for count in seen.values() if count > 1)
    ttft_ms = sorted(1000 * t for t in tally.ttft)
    p50 = statistics.median(ttft_ms) if ttft_ms else float("nan")
    p99 = ttft_ms[min(len(ttft_ms) - 1, int(0.99 * len(ttft_ms)))] if ttft_ms else float("nan")
    print(f"\n| soak ({seconds:.0f} s; tenant apps: {args.clients} streaming clients; tenant flood: a "
          f"{args.batch_lines}-line batch and {args.flood_clients} clients of n={args.flood_n}; 1 worker SIGKILLed, "
          "Redis restarted) | |\n|---|---|")
    for name, value in (("batch status", batch.get("status")), ("streams served", tally.served),
                        ("flood requests served", tally.flood_served),
                        ("server errors (5xx but 503 + Retry-After)", len(tally.server_errors)),
                        ("503 + Retry-After while Redis was away (tried again)", tally.unavailable),
                        ("stream errors", len(tally.errors)), ("time to first token p50", f"{p50:.0f} ms"),
                        ("time to first token p99", f"{p99:.0f} ms"), ("batch lines lost", lost),
                        ("batch lines duplicated", duplicated), ("requests resumed from a checkpoint", resumed),
                        ("redeliveries that waited on a live lease", handed_over)):
        print(f"| {name} | {value} |")
    for error in (tally.errors + tally.server_errors)[:5]:
        print("  error:", error)
    print(json.dumps({"seconds": seconds, "served": tally.served, "errors": len(tally.errors), "ttft_ms_p50": p50,
                      "ttft_ms_p99": p99, "lost": lost, "duplicated": duplicated, "resumed": resumed,
                      "status": batch.get("status"), "server_errors": len(tally.server_errors),
                      "unavailable": tally.unavailable, "flood_served": tally.flood_served}))
    return not lost and not duplicated and not tally.server_errors and batch.get("status") == "completed"


if __name__ == "__main__":
    main()
