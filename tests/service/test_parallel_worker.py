"""One Celery worker serves one tensor-parallel group end to end, as it serves one device: real
workers with LLMQ_TENSOR_PARALLEL_SIZE=2 (each drives a rank process of its own over gloo) stream
tokens, cancel and free every block, and, told to stop mid-batch, hand their work back to the other
worker, which resumes it from the checkpoints; the stopped worker's rank process ends with it. A
worker whose rank process is killed ends too, and another worker resumes its lines."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
from test_recovery import (
    GRACE_S,
    assert_batch_came_through,
    fault_stack,
    log_of,
    offline,  # noqa: F401 (a fixture)
    running_on,
    start_batch,
)
from test_streams import sse_events, submit

from tests.service.conftest import wait_until, worker_blocks


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def rank_processes() -> set[int]:
    """Pids of the rank processes (llmq.engine.rank_main) alive on this machine."""
    pids = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"llmq.engine.rank_main" in (entry / "cmdline").read_bytes():
                pids.add(int(entry.name))
        except OSError:
            continue
    return pids


def test_a_tensor_parallel_worker_streams_cancels_and_hands_back(served_model_dir, tmp_path, offline):  # noqa: F811
    before = rank_processes()
    with fault_stack(served_model_dir, tmp_path, LLMQ_TENSOR_PARALLEL_SIZE="2") as stack, \
            httpx.Client(base_url=stack.base_url, timeout=60) as api:
        stack.wait_for_workers(2)
        ours = rank_processes() - before
        assert len(ours) == 2, "each worker's engine should have started one rank process"
        assert "tensor shard 2/2" in log_of(tmp_path, "w0")
        beats = api.get("/v1/workers").json()["data"]
        assert {(w["tensor_parallel_size"], w["pipeline_parallel_size"], w["quantization"]) for w in beats} == {
            (2, 1, None)}

        prompt = "Once upon a time"
        request_id = submit(api, prompt=prompt, max_tokens=200, temperature=0, ignore_eos=True)
        with api.stream("GET", f"/v1/requests/{request_id}/events") as response:
            events = [json.loads(e["data"]) for e in sse_events(response)]
        assert events[-1]["type"] == "done"
        assert "".join(e["text"] for e in events if e["type"] == "delta") == offline[prompt]

        _, total = worker_blocks(api)
        cancel_id = submit(api, prompt=prompt, max_tokens=480, temperature=0, ignore_eos=True)
        wait_until(lambda: api.get(f"/v1/requests/{cancel_id}").json()["status"] == "running", interval=0.005)
        assert api.post(f"/v1/requests/{cancel_id}/cancel").status_code == 200
        wait_until(lambda: api.get(f"/v1/requests/{cancel_id}").json()["status"] == "cancelled", timeout=60)
        wait_until(lambda: worker_blocks(api) == (total, total), timeout=30)

        batch_id = start_batch(api)
        wait_until(lambda: running_on(api, "w0") > 0, timeout=120, interval=0.1)
        time.sleep(1.0)
        exit_code = stack.kill_worker("w0", signal.SIGTERM, timeout=GRACE_S + 20)
        assert exit_code == 0
        assert "handing its requests back" in log_of(tmp_path, "w0")
        assert_batch_came_through(api, stack, batch_id, offline)
        assert "from its checkpoint" in log_of(tmp_path, "w1"), "no handed-back line was resumed"
        wait_until(lambda: len(rank_processes() & ours) == 1, timeout=30)  # w0's rank ended with it

        stack.start_worker("w2")
        wait_until(lambda: any(w["name"].startswith("w2@") for w in api.get("/v1/workers").json()["data"]),
                   timeout=180)
        w1 = stack.workers["w1"]
        (w1_rank,) = [pid for pid in rank_processes() if parent_of(parent_of(pid)) == w1.pid]  # w1 -> engine -> rank
        batch_id = start_batch(api)
        wait_until(lambda: running_on(api, "w1") > 0, timeout=120, interval=0.1)
        time.sleep(1.0)
        os.kill(w1_rank, signal.SIGKILL)
        assert w1.wait(30) != 0, "a worker without its rank should end"
        assert "the engine cannot go on without all its ranks" in log_of(tmp_path, "w1")
        assert_batch_came_through(api, stack, batch_id, offline)
        assert "from its checkpoint" in log_of(tmp_path, "w2"), "no line of the ended worker was resumed"
    wait_until(lambda: not rank_processes() & ours, timeout=30)
