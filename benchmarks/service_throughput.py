"""The service vs the offline engine, on the shared bench workload, in one run.

    python benchmarks/service_throughput.py

Starts the whole service on this machine (a private Redis, SQLite, one Celery worker with the
bench-42m model, the web server) and runs the 64 requests of ../shared/bench/README.md three ways:
  offline   LLMEngine in this process (the reference)
  batch     one OpenAI batch file through HTTP -> Redis -> Celery -> the engine -> SQLite, the client
            polling the batch every --poll-seconds until it is completed; its time is the server's, from
            submission to the batch's completed_at (in the database, which keeps the fraction of a second)
  streams   64 requests through POST /v1/requests, each followed by its own SSE client
Prints useful tokens/s for each and the ratio to offline, and for the streams the latency from the
engine's step (the time stamped on each token event when the step returns) to the SSE client
receiving it: p50 / p90 / p99.

For each run it also prints where the time went: the worker's engine steps and the seconds it spent
in them (from its heartbeats), against the offline engine's, and the CPU seconds each process took
(Redis, the web server, the worker, this process: the offline engine or the clients).

The machine's speed drifts (shared, noisy: by a third within minutes), so the runs interleave,
offline, batch, offline, streams, offline, batch, ... for --rounds rounds, and each service run is
compared with the mean of the two offline runs on either side of it (benchmarks/bracketed.py); the
summary quotes the median of those ratios with a 90 % interval, and the latency over every streamed
event of every round.
Every run gets fresh prompts (engine_throughput.fresh_prompts): a repeat of the same prompts would
skip their prefill through the prefix cache.
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

import aiohttp
import httpx
import sqlalchemy
from sqlalchemy import select

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bracketed import bracketed_ratios, median_interval  # noqa: E402
from benchmarks.engine_throughput import bench_model_dir, fresh_prompts, run_llmq, workload  # noqa: E402
from llmq.engine.config import EngineConfig  # noqa: E402
from llmq.engine.llm import LLMEngine
from llmq.store.models import Batch  # noqa: E402
from stack.local import LocalStack  # noqa: E402

MODEL = "bench-42m"


def run_batch(client: httpx.Client, requests, poll_seconds: float, database_url: str) -> tuple[float, float]:
    """One batch file of the requests, through the Batch API; returns (seconds from submission to the
    batch's completion as the server recorded it, seconds until the polling client saw it). The first
    is the service's: the second adds up to one poll interval of the client's own."""
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                  "ignore_eos": True}})
             for i, (prompt, max_tokens) in enumerate(requests)]
    file_id = client.post("/v1/files", files={"file": ("bench.jsonl", "\n".join(lines).encode())},
                          data={"purpose": "batch"}).json()["id"]
    submitted, started = time.time(), time.perf_counter()
    batch = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                             "completion_window": "24h"}).json()
    while batch["status"] not in ("completed", "failed", "cancelled"):
        time.sleep(poll_seconds)
        batch = client.get(f"/v1/batches/{batch['id']}").json()
    seen = time.perf_counter() - started
    counts = batch["request_counts"]
    if batch["status"] != "completed" or counts["completed"] != len(requests):
        raise SystemExit(f"the bench batch did not complete: {batch}")
    # The API's timestamps are whole seconds (as OpenAI's); the database keeps the fraction.
    engine = sqlalchemy.create_engine(database_url)
    try:
        with engine.connect() as connection:
            completed_at = connection.scalar(select(Batch.completed_at).where(Batch.id == batch["id"]))
    finally:
        engine.dispose()
    return completed_at - submitted, seen


def run_streams(base_url: str, requests) -> tuple[float, list[float]]:
    """Every request submitted with POST /v1/requests and followed by its own SSE client on
    /v1/requests/{id}/events; returns (seconds, per-token latencies in s: the time the event's bytes
    reached the client's socket minus the time the worker stamped on it when the engine step returned).

    The 64 clients share this machine's two cores with the service they measure, and one asyncio loop:
    each notes when bytes arrive and parses them only after the run. (Parsing as they came, with
    aiohttp, a step's 64 events were stamped one after another behind the others' parsing, which put
    about 1.4 ms of the clients' own time into the median; 64 httpx clients in threads took about a
    fifth of the machine.)"""
    return asyncio.run(_run_streams(base_url, requests))


async def _run_streams(base_url: str, requests) -> tuple[float, list[float]]:
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(base_url, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        started = time.perf_counter()
        outcomes = await asyncio.gather(*(_stream_one(session, base_url, prompt, max_tokens, latencies)
                                          for prompt, max_tokens in requests), return_exceptions=True)
        seconds = time.perf_counter() - started
    errors = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
    if errors:  # a benchmark must not hide a failure
        raise SystemExit(f"{len(errors)} streaming clients failed, first: {errors[0]!r}")
    return seconds, latencies


class _ArrivalRecorder(asyncio.Protocol):
    """One HTTP response, kept as raw bytes with the time each piece arrived."""

    def __init__(self):
        self.received = bytearray()
        self.arrivals: list[tuple[int, float]] = []  # (bytes received so far, unix time)
        self.closed = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.received += data
        self.arrivals.append((len(self.received), time.time()))

    def connection_lost(self, exc) -> None:
        if not self.closed.done():
            self.closed.set_result(exc)

    def sse_data(self) -> list[tuple[float, dict]]:
        """(the time its last byte arrived, the event) for each SSE data line. One event is one HTTP
        chunk, so the chunked encoding's framing never splits a line."""
        ends = [end for end, _ in self.arrivals]
        return [(self.arrivals[bisect.bisect_left(ends, match.end())][1], json.loads(match.group(1)))
                for match in re.finditer(rb"^data: (\{.*)$", bytes(self.received), re.MULTILINE)]


async def follow_events(base_url: str, request_id: str) -> list[tuple[float, dict]]:
    """GET /v1/requests/{id}/events to its end: (the time its bytes arrived, the event) for each event."""
    url = urllib.parse.urlsplit(base_url)
    transport, recorder = await asyncio.get_running_loop().create_connection(_ArrivalRecorder, url.hostname, url.port)
    transport.write(f"GET /v1/requests/{request_id}/events HTTP/1.1\r\nHost: {url.netloc}\r\n"
                    "Accept: text/event-stream\r\nConnection: close\r\n\r\n".encode())
    await recorder.closed
    if not recorder.received.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"request {request_id}: {bytes(recorder.received[:200])!r}")
    return recorder.sse_data()


async def _stream_one(session: aiohttp.ClientSession, base_url: str, prompt, max_tokens: int,
                      latencies: list[float]) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with session.post("/v1/requests", json=body) as response:
        response.raise_for_status()
        request_id = (await response.json())["id"]
    tokens = 0
    for received, event in await follow_events(base_url, request_id):
        if event["type"] == "delta":
            tokens += len(event["token_ids"])
            latencies.append(received - event["t"])
    if tokens != max_tokens:
        raise RuntimeError(f"request {request_id}: got {tokens} tokens, asked for {max_tokens}")


def worker_totals(client: httpx.Client, fresher_than: float) -> dict:
    """The worker's engine-loop totals (steps, busy_seconds, tokens) from its first heartbeat sent
    after `fresher_than` (unix time): called while the engine is idle, so they are its totals now."""
    while True:
        beats = [w for w in client.get("/v1/workers").json()["data"] if w["at"] > fresher_than]
        if beats:
            return beats[0]
        time.sleep(0.2)


def describe_engine(path: str, before: dict, after: dict, wall: float) -> str:
    """How much of a run's wall time the worker's engine spent stepping, and in how many steps: a slower
    service is either slower steps (the cores shared with the rest of the service) or idle engine time."""
    steps, busy = after["steps"] - before["steps"], after["busy_seconds"] - before["busy_seconds"]
    return f"{path} {steps} steps, engine busy {busy:.2f} s of {wall:.2f} s ({busy / wall:.0%})"


def process_table() -> dict[int, tuple[int, float]]:
    """Every live process: pid -> (parent pid, CPU seconds used so far, user + system), from one pass
    over Linux's /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # it ended meanwhile
                continue
            table[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)  # ppid, utime + stime
    return table


def tree_cpu(table: dict[int, tuple[int, float]], pid: int, descendants: bool = True) -> float:
    """CPU seconds of a process and (with `descendants`) every live descendant of it."""
    children: dict[int, list[int]] = {}
    for child, (parent, _) in table.items():
        children.setdefault(parent, []).append(child)
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += table.get(current, (0, 0.0))[1]
        if descendants:
            todo += children.get(current, [])
    return total


class CpuMeter:
    """CPU seconds each part of the machine's work took during a span: the service's processes (Redis,
    the web server, the worker) and this process (the offline engine, or the clients). On two shared
    cores every CPU second outside the engine is time the engine's matrix products wait for."""

    def __init__(self, stack: LocalStack):
        self.parts = {"redis": stack.redis_process.pid, "web": stack.web_process.pid,
                      "worker": next(iter(stack.workers.values())).pid, "client": os.getpid()}

    def read(self) -> dict[str, float]:
        table = process_table()
        # This process started the others: its own CPU time is counted without theirs.
        return {name: tree_cpu(table, pid, descendants=name != "client") for name, pid in self.parts.items()}

    @staticmethod
    def describe(before: dict[str, float], after: dict[str, float]) -> str:
        return "CPU s " + ", ".join(f"{name} {after[name] - before[name]:.2f}" for name in before)


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else float("nan")


def main() -> None:
    args = _arguments()
    folder = bench_model_dir()
    requests = workload()
    max_num_seqs = 128
    # The offline engine is built as the worker builds its own (the same settings), in this process.
    runs = _Runs(LLMEngine(EngineConfig(model=str(folder), dtype="float32", max_num_seqs=max_num_seqs)), folder,
                 requests)
    with tempfile.TemporaryDirectory() as home:
        env = {"LLMQ_HOME": home, "DATABASE_URL": f"sqlite:///{home}/llmq.db", "MODEL_PATH": str(folder),
               "MODEL_NAME": MODEL,
               "LLMQ_DTYPE": "float32", "LLMQ_MAX_NUM_SEQS": str(max_num_seqs), "LLMQ_WORKER_THREADS": "160",
               **dict(item.split("=", 1) for item in args.worker_env)}
        # The web server runs as its own process (as the Procfile runs it), not beside the clients.
        with LocalStack(env, start_redis=True, log_dir=Path(home), web="gunicorn") as stack:
            cpu = CpuMeter(stack)
            with httpx.Client(base_url=stack.base_url, timeout=600) as client:
                print(f"offline run 1: {runs.offline(cpu)}", flush=True)
                for round_number in range(1, args.rounds + 1):
                    runs.round(round_number, stack, client, cpu, args.poll_seconds, env["DATABASE_URL"])
    report(sum(o for _, o in requests), runs.offline_times, runs.batch_times, runs.stream_runs)


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6,
                        help="rounds of batch and streams, each run between two offline runs (default 6; "
                             "5 or more give the median a 90%% interval)")
    parser.add_argument("--poll-seconds", type=float, default=0.5,
                        help="how often the batch client polls GET /v1/batches/{id} (default 0.5; polling 20 times a second took about a tenth of the "
                             "service's throughput on 2 cores, more often than any batch client polls)")
    parser.add_argument("--worker-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for the service processes (repeatable)")
    return parser.parse_args()


class _Runs:
    """Every run's time, in order: offline, then per round a batch, offline, streams, offline."""

    def __init__(self, offline_engine: LLMEngine, folder: Path, requests):
        self.offline_engine, self.folder, self.requests = offline_engine, folder, requests
        self.useful = sum(o for _, o in requests)
        self.offline_times, self.batch_times, self.stream_runs = [], [], []
        self.fresh = iter(range(1_000_000))  # every run below its own fresh prompts

    def offline(self, cpu: CpuMeter) -> str:
        cpu_start = cpu.read()
        offline = run_llmq(self.folder, self.requests, 1, engine=self.offline_engine, first_repeat=next(self.fresh))
        self.offline_times.append(offline["times"][0])
        return (f"offline {offline['steps']} steps, {self.offline_times[-1]:.2f} s, "
                + CpuMeter.describe(cpu_start, cpu.read()))

    def round(self, number: int, stack: LocalStack, client: httpx.Client, cpu: CpuMeter, poll_seconds: float,
              database_url: str) -> None:
        """A batch, an offline run, the streams, an offline run; prints the round's figures."""
        before, cpu_start = worker_totals(client, time.time()), cpu.read()
        batch_seconds, batch_seen = run_batch(client, fresh_prompts(self.requests, next(self.fresh)), poll_seconds,
                                              database_url)
        self.batch_times.append(batch_seconds)
        cpu_batch, after_batch = cpu.read(), worker_totals(client, time.time())
        offline_after_batch = self.offline(cpu)
        cpu_streams_start = cpu.read()
        self.stream_runs.append(run_streams(stack.base_url, fresh_prompts(self.requests, next(self.fresh))))
        cpu_streams, after_streams = cpu.read(), worker_totals(client, time.time())
        offline_after_streams = self.offline(cpu)
        batch_ratios, stream_ratios = path_ratios(self.offline_times, self.batch_times, self.stream_runs)
        stream_ms = [1000 * x for x in self.stream_runs[-1][1]]
        print(f"round {number}: batch {self.useful / batch_seconds:.1f} useful tokens/s, {batch_ratios[-1]:.0%} of "
              f"the offline runs around it (its client saw it {batch_seen - batch_seconds:.2f} s later); "
              f"streams {self.useful / self.stream_runs[-1][0]:.1f}, {stream_ratios[-1]:.0%}; "
              f"step -> SSE p50 {percentile(stream_ms, 50):.2f} ms", flush=True)
        print("  " + describe_engine("batch", before, after_batch, batch_seconds) + ", "
              + CpuMeter.describe(cpu_start, cpu_batch), flush=True)
        print(f"  offline run {2 * number}: {offline_after_batch}", flush=True)
        print("  " + describe_engine("streams", after_batch, after_streams, self.stream_runs[-1][0]) + ", "
              + CpuMeter.describe(cpu_streams_start, cpu_streams), flush=True)
        print(f"  offline run {2 * number + 1}: {offline_after_streams}", flush=True)


def path_ratios(offline_times: list[float], batch_times: list[float],
                stream_runs: list[tuple[float, list[float]]]) -> tuple[list[float], list[float]]:
    """Each batch and streams run against the offline runs around it, in the order they ran:
    offline 0, batch 0, offline 1, streams 0, offline 2, batch 1, ..."""
    in_order = [seconds for batch, (streams, _) in zip(batch_times, stream_runs) for seconds in (batch, streams)]
    every_ratio = bracketed_ratios(offline_times, in_order)
    return every_ratio[0::2], every_ratio[1::2]


def report(useful: int, offline_times: list[float], batch_times: list[float],
           stream_runs: list[tuple[float, list[float]]]) -> None:
    """The summary: each path's runs against the offline runs around them (path_ratios), and the
    token latency over every streamed event."""
    stream_times = [seconds for seconds, _ in stream_runs]
    batch_ratios, stream_ratios = path_ratios(offline_times, batch_times, stream_runs)
    ratios = {"batch": batch_ratios, "streams": stream_ratios}
    print("\n| path | useful tokens/s (best run) | vs the offline runs around it: median [90 % interval] | each run |"
          "\n|---|---|---|---|")
    print(f"| offline engine | {useful / min(offline_times):.1f} | | "
          f"{useful / max(offline_times):.0f}–{useful / min(offline_times):.0f} tok/s |")
    for name, times, key in (("batch via HTTP + Redis + Celery", batch_times, "batch"),
                             ("64 requests + 64 SSE clients", stream_times, "streams")):
        interval = median_interval(ratios[key])
        summary = (f"{interval[1]:.0%} [{interval[0]:.0%}, {interval[2]:.0%}]" if interval
                   else f"{statistics.median(ratios[key]):.0%} (too few runs for an interval)")
        print(f"| {name} | {useful / min(times):.1f} | {summary} | {', '.join(f'{r:.0%}' for r in ratios[key])} |")
    latencies_ms = [1000 * x for _, run in stream_runs for x in run]
    round_p50s = [percentile([1000 * x for x in run], 50) for _, run in stream_runs]
    print(f"\nstep -> SSE client latency over all {len(latencies_ms)} token events of {len(stream_runs)} runs: "
          f"p50 {percentile(latencies_ms, 50):.2f} ms, p90 {percentile(latencies_ms, 90):.2f} ms, "
          f"p99 {percentile(latencies_ms, 99):.2f} ms (each run's p50: {min(round_p50s):.2f}–{max(round_p50s):.2f} ms)")
    print(json.dumps({"useful_tokens": useful, "offline_s": offline_times, "batch_s": batch_times,
                      "streams_s": stream_times, "batch_ratios": ratios["batch"], "streams_ratios": ratios["streams"],
                      "latency_ms_p50": percentile(latencies_ms, 50), "latency_ms_p99": percentile(latencies_ms, 99)}))


if __name__ == "__main__":
    main()
