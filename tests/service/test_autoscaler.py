"""`llmq autoscale` with real processes: a private Redis, the web, and the Celery workers the
autoscaler itself starts and stops (stack/worker_backends.py's local backend), with delays short
enough for a test (upscale 1 s, downscale 10 s, a tick a second).

- A burst of batch lines takes the fleet from its minimum of 1 worker to its maximum of 3; the batch
  completes with every line exactly once and as the offline engine writes it; the fleet comes back
  to 1 after the downscale delay, the extra workers stopped with SIGTERM (each hands its work back).
- With a minimum of 0 no worker runs; a request arrives, waits in the queue while the autoscaler
  starts one, and is served; after the downscale delay the fleet is back at 0.

Each worker's start-up (process start to ready, and to its first token where the test sees it) is
printed (pytest -s), as is the fleet over time.
"""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from llmq import fleet
from llmq.engine.llm import LLM
from llmq.sampling_params import SamplingParams
from stack.local import REPO_ROOT, LocalStack
from tests.service.conftest import MODEL_NAME, wait_until
from tests.service.test_recovery import (
    MAX_TOKENS,
    PROMPTS,
    assert_every_line_once_and_equal_to_offline,
    start_batch,
    wait_for_end,
)

AUTOSCALE_ENV = {"LLMQ_MAX_NUM_SEQS": "4", "LLMQ_HEARTBEAT_SECONDS": "1", "LLMQ_SHUTDOWN_GRACE_SECONDS": "10",
                 "LLMQ_AUTOSCALE_MIN": "1", "LLMQ_AUTOSCALE_MAX": "3", "LLMQ_AUTOSCALE_UPSCALE_DELAY": "1",
                 "LLMQ_AUTOSCALE_DOWNSCALE_DELAY": "10", "LLMQ_AUTOSCALE_TICK_SECONDS": "1",
                 "LLMQ_AUTOSCALE_STARTUP_SECONDS": "10"}
BURST = PROMPTS * 2  # 32 lines of 200 tokens: one worker of 4 sequences is busy long after the others start


@pytest.fixture(scope="module")
def offline(served_model_dir) -> dict[str, str]:
    """Each prompt's greedy text from the offline engine, as start_batch asks for it."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = LLM(str(served_model_dir), dtype="float32").generate(PROMPTS, params, use_tqdm=False)
    return {prompt: output.text for prompt, output in zip(PROMPTS, outputs)}


@dataclass
class Running:
    stack: LocalStack
    process: subprocess.Popen
    log_path: Path
    client: redis.Redis

    def log(self) -> str:
        return self.log_path.read_text()

    def workers(self) -> int:
        return len(fleet.live_workers(self.client, 30, MODEL_NAME))

    def status(self) -> dict | None:
        return fleet.autoscalers(self.client, 30).get(MODEL_NAME)


def autoscaled_stack(served_model_dir, tmp_path, **env) -> LocalStack:
    home = tmp_path / "home"
    return LocalStack({"LLMQ_HOME": str(home), "DATABASE_URL": f"sqlite:///{home / 'llmq.db'}",
                       "MODEL_PATH": str(served_model_dir), "MODEL_NAME": MODEL_NAME, **AUTOSCALE_ENV, **env},
                      start_redis=True, workers=0, log_dir=tmp_path)


def start_autoscaler(stack: LocalStack, tmp_path: Path) -> Running:
    log_path = tmp_path / "autoscaler.log"
    out = open(log_path, "a")
    process = subprocess.Popen([sys.executable, "-m", "stack.cli", "autoscale", "--log-dir", str(tmp_path)],
                               cwd=REPO_ROOT, env=stack.env, stdout=out, stderr=subprocess.STDOUT)
    out.close()
    return Running(stack, process, log_path, redis.Redis.from_url(stack.redis_url))


def stop_autoscaler(running: Running) -> None:
    """SIGTERM, as a process manager stops it: it stops its workers and exits."""
    if running.process.poll() is None:
        running.process.send_signal(signal.SIGTERM)
        try:
            running.process.wait(60)
        except subprocess.TimeoutExpired:
            running.process.kill()
            running.process.wait()


class Timeline:
    """The fleet every half second, from a thread: (seconds, live workers, and the autoscaler's desired,
    queued and in flight)."""

    def __init__(self, running: Running):
        self.running, self.rows, self._stop = running, [], threading.Event()
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while not self._stop.wait(0.5):
            status = self.running.status() or {}
            self.rows.append((time.monotonic() - self.started, self.running.workers(), status.get("desired"),
                              status.get("queued"), status.get("in_flight")))

    def stop(self) -> list[tuple]:
        self._stop.set()
        self._thread.join(5)
        return self.rows

    def changes(self) -> str:
        """The rows where the workers or the desired count changed."""
        kept, last = [], None
        for row in self.rows:
            if row[1:3] != last:
                kept.append(f"  {row[0]:6.1f} s  workers {row[1]}  desired {row[2]}  queued {row[3]}  "
                            f"on workers {row[4]}")
                last = row[1:3]
        return "\n".join(kept)


def ready_seconds(log: str) -> list[float]:
    return [float(s) for s in re.findall(r"ready (\d+\.\d) s after its process started", log)]


def started_at(log: str) -> dict[str, float]:
    return {name: float(t) for name, t in re.findall(r"started worker (\S+) \(pid \d+\) at (\d+\.\d+)", log)}


def test_a_burst_scales_the_fleet_up_to_max_and_back_down_losing_nothing(served_model_dir, tmp_path, offline):
    with autoscaled_stack(served_model_dir, tmp_path) as stack, \
            httpx.Client(base_url=stack.base_url, timeout=60) as api:
        running = start_autoscaler(stack, tmp_path)
        try:
            wait_until(lambda: running.workers() == 1, timeout=120, interval=0.2)  # the minimum, started
            timeline = Timeline(running)
            batch_id = start_batch(api, BURST)
            wait_until(lambda: running.workers() == 3, timeout=120, interval=0.2)
            up_at = time.monotonic() - timeline.started
            batch = wait_for_end(api, batch_id, timeout=300)
            done_at = time.monotonic() - timeline.started
            # Back to the minimum once the demand has asked for fewer workers for the downscale delay.
            wait_until(lambda: running.workers() == 1 and (running.status() or {}).get("actual") == 1, timeout=90,
                       interval=0.2)
            down_at = time.monotonic() - timeline.started
            time.sleep(3)  # and it stays there
            rows = timeline.stop()
            assert running.workers() == 1 and running.process.poll() is None
        finally:
            stop_autoscaler(running)
        log = running.log()
        print(f"\nfleet over time (burst of {len(BURST)} lines at 0 s):\n{timeline.changes()}")
        print(f"3 workers at {up_at:.1f} s, batch completed at {done_at:.1f} s, back to 1 worker at {down_at:.1f} s")
        startups = ready_seconds(log)
        print("worker start-up, process start to ready: " + ", ".join(f"{s:.1f} s" for s in startups))

        assert_every_line_once_and_equal_to_offline(api, batch, offline, BURST)
        assert max(r[1] for r in rows) == 3 and all(r[1] <= 3 for r in rows)
        assert len(started_at(log)) == 3 and len(startups) == 3, log
        stops = re.findall(r"stopping worker (\S+) .*; held (\d+) s \(delay 10 s\)", log)
        assert len(stops) == 2 and all(int(held) >= 10 for _, held in stops), log
        for name, _ in stops:  # handed its work back and exited cleanly, before the autoscaler itself stopped
            assert re.search(rf"worker {name} exited \(code 0\) [\d.]+ s after it was told to stop\n(.*\n)*"
                             r".*SIGTERM: stopping", log), log
        assert "exited on its own" not in log


def test_min_zero_starts_a_worker_for_a_waiting_request(served_model_dir, tmp_path):
    prompt = PROMPTS[0]
    expected = LLM(str(served_model_dir), dtype="float32").generate(prompt, SamplingParams(temperature=0, max_tokens=20),
                                                   use_tqdm=False)[0].text
    with autoscaled_stack(served_model_dir, tmp_path, LLMQ_AUTOSCALE_MIN="0", LLMQ_AUTOSCALE_MAX="1") as stack, \
            httpx.Client(base_url=stack.base_url, timeout=60) as api:
        running = start_autoscaler(stack, tmp_path)
        try:
            wait_until(lambda: (s := running.status()) is not None and s["actual"] == 0 and s["desired"] == 0,
                       timeout=60, interval=0.2)
            time.sleep(2)
            assert running.workers() == 0 and "started worker" not in running.log()
            response = api.post("/v1/requests", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 20,
                                                      "temperature": 0})
            assert response.status_code == 202, response.text
            request_id = response.json()["id"]
            done = wait_until(lambda: (r := api.get(f"/v1/requests/{request_id}").json())["status"] in
                              ("completed", "failed") and r, timeout=180, interval=0.2)
            assert done["status"] == "completed" and done["text"] == expected, done
            wait_until(lambda: ready_seconds(running.log()), timeout=30, interval=0.2)  # its next tick notes it
            launched = started_at(running.log())
            assert len(launched) == 1
            worker_started = next(iter(launched.values()))
            print(f"\nrequest arrived, worker process started {worker_started - done['created_at']:.1f} s later; "
                  f"start-up, process start to ready: {ready_seconds(running.log())[0]:.1f} s, to the request's "
                  f"first token: {done['first_token_at'] - worker_started:.1f} s; the request waited "
                  f"{done['first_token_at'] - done['created_at']:.1f} s for its first token")
            assert worker_started - done["created_at"] < 5  # within a few ticks: no upscale delay from zero
            wait_until(lambda: running.workers() == 0 and (running.status() or {}).get("actual") == 0, timeout=60,
                       interval=0.2)
            wait_until(lambda: "exited (code 0)" in running.log(), timeout=30, interval=0.2)
        finally:
            stop_autoscaler(running)
