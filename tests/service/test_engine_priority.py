"""LLMQ_ENGINE_NICE reaches the engine's threads and only them (the service tests' stack sets 10)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


def thread_nice_values(pid: int) -> dict[int, int]:
    """Each thread of a process -> its nice value (field 19 of /proc/<pid>/task/<tid>/stat)."""
    values = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        values[int(task.name)] = int(fields[16])
    return values


def test_the_engine_loop_runs_at_nice_10_and_the_celery_threads_at_0(stack, api):
    assert api.get("/v1/workers").json()["data"], "no worker heartbeat"
    worker_pid = stack.workers["w0"].pid
    nice = thread_nice_values(worker_pid)
    lowered = [tid for tid, value in nice.items() if value == 10]
    assert nice[worker_pid] == 0, "the worker's main thread (Celery's consumer) keeps the default priority"
    assert lowered, f"no thread of the worker runs at nice 10: {nice}"
    # Everything else (the consumer, the task threads, the heartbeat) stays at the process's priority.
    assert sorted(set(nice.values())) == [0, 10]
    assert len(lowered) < len(nice) / 2
