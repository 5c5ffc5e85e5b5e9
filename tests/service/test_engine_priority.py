"""LLMQ_ENGINE_NICE reaches the engine's threads and only them (the service tests' stack sets 10): the
loop and its compute threads in the engine process, not the Celery worker's threads."""
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


def child_pids(pid: int) -> list[int]:
    """The processes `pid` started with multiprocessing's spawn (not its resource tracker)."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid \
                        and b"spawn_main" in (entry / "cmdline").read_bytes():
                    children.append(int(entry.name))
            except OSError:
                continue
    return children


def test_the_engine_loop_runs_at_nice_10_and_the_celery_threads_at_0(stack, api):
    assert api.get("/v1/workers").json()["data"], "no worker heartbeat"
    worker_pid = stack.workers["w0"].pid
    assert set(thread_nice_values(worker_pid).values()) == {0}, "the worker's threads keep the default priority"
    [engine_pid] = child_pids(worker_pid)  # the engine process (workers/engine_process.py)
    nice = thread_nice_values(engine_pid)
    lowered = [tid for tid, value in nice.items() if value == 10]
    assert nice[engine_pid] == 0, "the engine process's main thread (it reads the worker's messages) keeps it too"
    assert lowered, f"no thread of the engine process runs at nice 10: {nice}"
    assert sorted(set(nice.values())) == [0, 10]
