"""The fleet with real processes and the default timings: a worker killed outright has its requests
running again on another within a minute (its lease plus one sweep, not the broker's hour), and a
worker that joins in the middle of a batch takes a fair share of what remains (workers take work by
capacity). Each test starts its own stack (a private Redis, Celery workers, gunicorn); both print
the figure they measure (pytest -s shows it)."""
from __future__ import annotations

import dataclasses
import signal
import time

import httpx
import redis

from llmq import fleet
from llmq.engine.llm import LLM
from llmq.events import lease_key, stream_key
from llmq.sampling_params import SamplingParams
from llmq.settings import Settings
from stack.local import LocalStack
from tests.service.conftest import MODEL_NAME, wait_until
from tests.service.test_recovery import PROMPTS, assert_batch_came_through, log_of, start_batch
from workers.capacity import headroom

DEFAULTS = {f.name: f.default for f in dataclasses.fields(Settings)}  # as a new user has them
FORTY = [f"{p} {k}" for k in ("", "and", "so") for p in PROMPTS][:40]


def default_stack(served_model_dir, tmp_path, workers: int, **env) -> LocalStack:
    """A stack with llmq's default heartbeats, leases, sweep and visibility timeout."""
    home = tmp_path / "home"
    return LocalStack({"LLMQ_HOME": str(home), "DATABASE_URL": f"sqlite:///{home / 'llmq.db'}",
                       "MODEL_PATH": str(served_model_dir), "MODEL_NAME": MODEL_NAME, **env},
                      start_redis=True, workers=workers, log_dir=tmp_path, web="gunicorn")


def leased_by(client: redis.Redis, prefix: str) -> list[str]:
    """The requests whose lease the worker named `prefix`@... holds now."""
    held = []
    for key in client.scan_iter(match=lease_key("*")):
        owner = client.get(key)
        if owner is not None and owner.decode().startswith(prefix + "@"):
            held.append(key.decode().split(":", 2)[2])
    return held


def test_a_killed_workers_requests_run_again_within_a_minute_with_the_default_settings(served_model_dir, tmp_path):
    lease, sweep = DEFAULTS["lease_seconds"], DEFAULTS["sweep_seconds"]
    assert (lease, sweep, DEFAULTS["visibility_timeout"]) == (30, 10, 3600)
    max_tokens = 200
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    offline = {p: o.text for p, o in zip(FORTY, LLM(str(served_model_dir), dtype="float32").generate(FORTY, params, use_tqdm=False))}
    with default_stack(served_model_dir, tmp_path, workers=2, LLMQ_MAX_NUM_SEQS="8") as stack, \
            httpx.Client(base_url=stack.base_url, timeout=60) as api:
        client = redis.Redis.from_url(stack.redis_url)
        batch_id = start_batch(api, FORTY)
        victims = wait_until(lambda: len(leased_by(client, "w0")) >= 3 and leased_by(client, "w0"),
                             timeout=120, interval=0.1)
        time.sleep(1.0)  # well into generation: its lines have streamed tokens
        lengths = {request_id: client.xlen(stream_key(request_id)) for request_id in victims}
        killed_at = time.monotonic()
        assert stack.kill_worker("w0", signal.SIGKILL) == -signal.SIGKILL

        def resumed() -> bool:
            return any(client.xlen(stream_key(r)) > n for r, n in lengths.items())

        wait_until(resumed, timeout=90, interval=0.2)
        took = time.monotonic() - killed_at
        print(f"\nSIGKILL to the killed worker's requests running again: {took:.1f} s (defaults: lease {lease} s, "
              f"a sweep every {sweep} s, visibility timeout {DEFAULTS['visibility_timeout']} s)")
        assert took < min(60, lease + 2 * sweep), f"{took:.1f} s"
        assert_batch_came_through(api, stack, batch_id, offline, FORTY, timeout=600)
        assert "go to the queue again" in log_of(tmp_path, "w1")
        assert "from its checkpoint" in log_of(tmp_path, "w1"), "no line was resumed from a checkpoint"


def test_a_worker_that_joins_mid_batch_runs_a_fair_share_of_what_remains(served_model_dir, tmp_path):
    lines, max_tokens = [f"{p} {k}" for k in range(6) for p in PROMPTS], 96
    with default_stack(served_model_dir, tmp_path, workers=1, LLMQ_MAX_NUM_SEQS="4",
                       LLMQ_HEARTBEAT_SECONDS="1") as stack, httpx.Client(base_url=stack.base_url, timeout=60) as api:
        batch_id = start_batch(api, lines, max_tokens=max_tokens)
        counts = lambda: api.get(f"/v1/batches/{batch_id}").json()["request_counts"]  # noqa: E731
        wait_until(lambda: counts()["completed"] >= len(lines) // 8, timeout=300, interval=0.2)
        stack.start_worker("w1")
        stack.wait_for_workers(2)
        remaining = len(lines) - counts()["completed"]
        wait_until(lambda: counts()["completed"] == len(lines), timeout=600, interval=0.5)
        time.sleep(2.5)  # a heartbeat after the last step
        beats = {w["name"].split("@")[0]: w for w in api.get("/v1/workers").json()["data"]}
        share = beats["w1"]["tokens"] / (remaining * max_tokens)
        print(f"\nthe worker that joined with {remaining} of {len(lines)} lines left ran {100 * share:.0f} % of them "
              f"({beats['w1']['tokens']} of {remaining * max_tokens} tokens)")
        assert share >= 0.4


def test_a_worker_holds_only_what_its_engine_can_run_soon_and_the_rest_waits_in_the_queue(served_model_dir, tmp_path):
    # Threads to spare, for one tenant too: only the capacity gate keeps the worker from taking every line.
    with default_stack(served_model_dir, tmp_path, workers=1, LLMQ_MAX_NUM_SEQS="2", LLMQ_WORKER_THREADS="32",
                       LLMQ_TENANT_THREADS="32", LLMQ_HEARTBEAT_SECONDS="1") as stack, \
            httpx.Client(base_url=stack.base_url, timeout=60) as api:
        client = redis.Redis.from_url(stack.redis_url)
        batch_id = start_batch(api, PROMPTS, max_tokens=200)
        limit = 2 + headroom(2)
        seen = []

        def sample() -> bool:
            beat = api.get("/v1/workers").json()["data"][0]
            seen.append((beat.get("held", 0), sum(fleet.queue_depth(client, MODEL_NAME).values())))
            return api.get(f"/v1/batches/{batch_id}").json()["status"] == "completed"

        wait_until(sample, timeout=300, interval=0.3)
        held = [h for h, _ in seen]
        print(f"\nheld at most {max(held)} tasks (limit {limit}); queue depth up to {max(q for _, q in seen)}")
        assert max(held) <= limit, seen
        assert max(held) >= 2 and any(q >= len(PROMPTS) // 2 for _, q in seen), seen
