"""What the metrics recorder costs the engine loop, on the shared bench workload.

    python benchmarks/metrics_overhead.py [--runs 3]

Runs an EngineService as a worker runs it (the bench-42m model, its token events written to a
private Redis) through the 64 requests of ../shared/bench/README.md, `--runs` times with fresh
prompts, with every call the loop makes into its RequestMetrics (workers/request_metrics.py) timed,
and prints the recorder's share of each run's wall time. Timing a call adds two clock reads to it,
so the share is an upper bound. A share, not two runs' throughputs compared: on a shared 2-core
machine two runs of the same code differ by far more than the recorder costs, and the share is the
same however slow the machine runs that minute. benchmarks/service_throughput.py with
`--worker-env LLMQ_METRICS=0` compares the whole service with the recorder on and off.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_throughput import bench_model_dir, fresh_prompts, workload  # noqa: E402
from llmq.embedded_redis import start_redis_server, wait_for_redis  # noqa: E402
from llmq.engine.config import EngineConfig  # noqa: E402
from llmq.sampling_params import SamplingParams  # noqa: E402
from stack.local import free_port  # noqa: E402
from workers import service as service_module  # noqa: E402
from workers.job import Job  # noqa: E402
from workers.messages import EngineRequest  # noqa: E402
from workers.publisher import StreamPublisher  # noqa: E402
from workers.request_metrics import RequestMetrics  # noqa: E402


def _timed(name: str):
    method = getattr(RequestMetrics, name)

    def timed(self, *args):
        started = time.perf_counter()
        method(self, *args)
        TimedMetrics.seconds += time.perf_counter() - started
        TimedMetrics.calls += 1
    return timed


class TimedMetrics(RequestMetrics):
    """RequestMetrics whose every call the loop makes adds its time to `seconds`."""

    seconds = 0.0
    calls = 0
    arrived, scheduled, delta = _timed("arrived"), _timed("scheduled"), _timed("delta")
    finished, forget = _timed("finished"), _timed("forget")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs of the 64 requests (default 3)")
    args = parser.parse_args()
    requests = workload()
    service_module.RequestMetrics = TimedMetrics  # the service builds its recorder from this name
    with tempfile.TemporaryDirectory() as home:
        port = free_port()
        server = start_redis_server(Path(home), port, daemonize=False)
        try:
            url = f"redis://127.0.0.1:{port}/0"
            wait_for_redis(url)
            service = service_module.EngineService(
                lambda: service_module.load_and_warm(EngineConfig(str(bench_model_dir()), dtype="float32",
                                                                  max_num_seqs=128)),
                StreamPublisher(redis.Redis.from_url(url), maxlen=1000, ttl=60), metrics=True)
            service.start()
            try:
                shares = [run(service, requests, repeat) for repeat in range(args.runs)]
            finally:
                service.stop()
        finally:
            server.terminate()
            server.wait(10)
    print(f"recorder share of the wall time, each run: {', '.join(f'{s:.4%}' for s in shares)}")


def run(service, requests, repeat: int) -> float:
    TimedMetrics.seconds, TimedMetrics.calls = 0.0, 0
    jobs = [Job(EngineRequest(f"r{repeat}-{i}", [prompt], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                          ignore_eos=True)))
            for i, (prompt, max_tokens) in enumerate(fresh_prompts(requests, repeat))]
    started = time.perf_counter()
    for job in jobs:
        service.submit(job)
    for job in jobs:
        job.outcome.done(None)
    wall = time.perf_counter() - started
    tokens = sum(o.completion_tokens for o in (job.outcome.result for job in jobs))
    share = TimedMetrics.seconds / wall
    print(f"run {repeat + 1}: {tokens} tokens in {wall:.2f} s ({tokens / wall:.0f} tok/s); recorder "
          f"{1e3 * TimedMetrics.seconds:.1f} ms in {TimedMetrics.calls} calls "
          f"({1e6 * TimedMetrics.seconds / TimedMetrics.calls:.2f} us each): {share:.4%} of the run", flush=True)
    return share


if __name__ == "__main__":
    main()
