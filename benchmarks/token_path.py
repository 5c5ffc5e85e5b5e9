"""The token path alone: how long a step's events take from a worker's write to its SSE clients, with
no engine running.

    python benchmarks/token_path.py [--clients 64] [--steps 100] [--step-ms 60]

Starts a private Redis and the web server (gunicorn, as the Procfile runs it; no worker) and creates
the requests through POST /v1/requests. A writer process then stands in for a worker's engine loop:
every --step-ms it stamps one delta event per request with the time and writes them as a worker
writes a step (llmq.streams.write_events: one script call, published whole on llmq:steps). Each
client follows GET /v1/requests/{id}/events as service_throughput.py's do (one asyncio loop, bytes
stamped as they arrive). Prints how long the writes took, the write -> client latency p50 / p90 /
p99 (the floor under service_throughput.py's step -> SSE latency, which adds the engine's
competition for the same cores) and the web server's CPU time: opening the streams, and per event.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_throughput import bench_model_dir  # noqa: E402
from benchmarks.service_throughput import follow_events, percentile, process_table, tree_cpu  # noqa: E402
from llmq.events import DeltaEvent, DoneEvent, Usage  # noqa: E402
from llmq.streams import EventWrite, write_events  # noqa: E402
from stack.local import LocalStack  # noqa: E402


def write_steps(redis_url: str, request_ids: list[str], steps: int, step_ms: float, start, write_ms,
                web_pid: int, web_cpu) -> None:
    """A worker's engine loop without the engine: one delta per request every step_ms, then the end.
    Notes the web server's CPU seconds before the clients start, once they have opened their streams
    (just before the first step) and after the last step: what opening the streams took, and what
    the events took (their streams' ends included)."""
    client = redis.Redis.from_url(redis_url)
    web_cpu.append(tree_cpu(process_table(), web_pid))
    start.wait()
    time.sleep(1.0)  # the clients are connected and waiting
    web_cpu.append(tree_cpu(process_table(), web_pid))
    for number in range(1, steps + 2):
        next_step = time.perf_counter() + step_ms / 1000
        now = time.time()
        event = DoneEvent(Usage(0, steps), now) if number > steps else DeltaEvent(0, " tok", (number,), t=now)
        write_events(client, [EventWrite(request_id, [event], number) for request_id in request_ids], 10_000)
        write_ms.append(1000 * (time.time() - now))
        time.sleep(max(0.0, next_step - time.perf_counter()))
    time.sleep(0.2)  # the last events reach their clients
    web_cpu.append(tree_cpu(process_table(), web_pid))


async def follow_all(base_url: str, request_ids: list[str]) -> list[float]:
    latencies = []
    for events in await asyncio.gather(*(follow_events(base_url, request_id) for request_id in request_ids)):
        latencies += [1000 * (received - event["t"]) for received, event in events if event["type"] == "delta"]
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64, help="streams followed at once (default 64)")
    parser.add_argument("--steps", type=int, default=100, help="events per stream (default 100)")
    parser.add_argument("--step-ms", type=float, default=60.0,
                        help="time between steps (default 60, about a bench-42m step of 64 sequences here)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as home:
        # With no worker nothing loads the model; the API reads its context length and tokenizer.
        env = {"LLMQ_HOME": home, "DATABASE_URL": f"sqlite:///{home}/llmq.db", "MODEL_NAME": "m",
               "MODEL_PATH": str(bench_model_dir())}
        with LocalStack(env, start_redis=True, workers=0, log_dir=Path(home), web="gunicorn") as stack:
            with httpx.Client(base_url=stack.base_url) as client:
                request_ids = [client.post("/v1/requests", json={"model": "m", "prompt": "x", "max_tokens": 5})
                               .json()["id"] for _ in range(args.clients)]
            with multiprocessing.Manager() as manager:
                start, write_ms, web_cpu = manager.Event(), manager.list(), manager.list()
                writer = multiprocessing.Process(target=write_steps, args=(stack.redis_url, request_ids, args.steps,
                                                                          args.step_ms, start, write_ms,
                                                                          stack.web_process.pid, web_cpu))
                writer.start()
                start.set()
                latencies = asyncio.run(follow_all(stack.base_url, request_ids))
                writer.join()
                writes, (cpu_before, cpu_opened, cpu_after) = list(write_ms), list(web_cpu)
    print(f"{args.clients} streams, {args.steps} steps {args.step_ms:.0f} ms apart, no engine")
    print(f"writing a step's events: p50 {statistics.median(writes):.2f} ms")
    print(f"write -> SSE client over {len(latencies)} events: p50 {percentile(latencies, 50):.2f} ms, "
          f"p90 {percentile(latencies, 90):.2f} ms, p99 {percentile(latencies, 99):.2f} ms")
    events = args.clients * (args.steps + 1)
    print(f"web server CPU: opening the {args.clients} streams (GET .../events) {1000 * (cpu_opened - cpu_before):.0f} ms, "
          f"{1000 * (cpu_opened - cpu_before) / args.clients:.1f} ms each; then {1e6 * (cpu_after - cpu_opened) / events:.0f} µs "
          f"per event over {events} events")


if __name__ == "__main__":
    main()
