"""The local worker backend's bookkeeping (stack/worker_backends.py) with real processes: small
Python programs in place of Celery workers (the service test, tests/service/test_autoscaler.py,
runs the real ones). Started, listed, stopped with SIGTERM, reaped with their exit codes, logged."""
from __future__ import annotations

import sys
import time

from stack.worker_backends import LocalBackend, celery_worker_command

# Says its name and environment, then exits 0 at a SIGTERM (as a worker does after handing back).
POLITE = ("import os, signal, sys, time; print(sys.argv[1], os.environ['MODEL_NAME'], flush=True); "
          "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); time.sleep(60)")
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"


def backend(tmp_path, script: str) -> LocalBackend:
    return LocalBackend(lambda model: {"MODEL_NAME": model, "PATH": "/usr/bin:/bin"}, tmp_path,
                        command=lambda name: [sys.executable, "-c", script, name])


def wait_for_exits(backend: LocalBackend, count: int, timeout: float = 20.0) -> list:
    exited, deadline = [], time.monotonic() + timeout
    while len(exited) < count and time.monotonic() < deadline:
        exited += backend.reap()
        time.sleep(0.05)
    return exited


def test_start_list_stop_and_reap(tmp_path):
    local = backend(tmp_path, POLITE)
    one, two = local.start("m/a"), local.start("other")
    assert one.name != two.name and one.name.endswith("-m_a-1") and two.name.endswith("-other-2")
    assert [w.name for w in local.workers("m/a")] == [one.name] and len(local.workers()) == 2
    deadline = time.monotonic() + 20
    while not one.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert one.log_path.read_text() == f"{one.name} m/a\n"  # its own log file, its model's environment
    local.stop(one.name)
    assert one.stopping_since is not None and one in local.workers()  # listed until it has exited
    assert wait_for_exits(local, 1) == [one] and one.exit_code == 0
    assert local.workers() == [two]
    local.close(timeout=10)
    assert local.reap() == [two] and two.exit_code == 0 and local.workers() == []


def test_a_worker_that_exits_on_its_own_is_reaped_with_its_code(tmp_path):
    local = backend(tmp_path, "import sys; sys.exit(3)")
    worker = local.start("m")
    assert wait_for_exits(local, 1) == [worker]
    assert worker.exit_code == 3 and worker.stopping_since is None and local.workers() == []


def test_close_kills_a_worker_that_does_not_stop_in_time(tmp_path):
    local = backend(tmp_path, STUBBORN)
    local.start("m")
    time.sleep(0.5)  # its SIGTERM handler is set
    started = time.monotonic()
    local.close(timeout=1)
    assert time.monotonic() - started < 10
    assert [w.exit_code for w in wait_for_exits(local, 1)] == [-9]


def test_the_worker_command_is_the_procfiles_with_a_name():
    command = celery_worker_command("auto1-m-1")
    assert command[1:] == ["-m", "celery", "-A", "workers.celery_app", "worker", "--loglevel", "INFO",
                           "-n", "auto1-m-1@%h", "--without-gossip", "--without-mingle"]
