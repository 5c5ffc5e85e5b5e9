"""What starts and stops the autoscaler's workers. A backend does three things: start a worker of a
model, stop one by name, and list the ones it started that still run. Stopping is a SIGTERM (or
what stands for it), which a worker answers by handing its requests back to the queue at once
(workers/celery_app.py), so a scale-down loses no work and nothing is started to replace it.

`local`: worker processes on this machine, each a Celery worker as the Procfile runs one, with its
own log file. Kubernetes is scaled by KEDA from the same queue lengths instead (deploy/).
"""
from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[1]


def celery_worker_command(name: str) -> list[str]:
    """The command of one worker process, named `name@<host>` in Celery and in its heartbeats."""
    return [sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker", "--loglevel", "INFO",
            "-n", f"{name}@%h", "--without-gossip", "--without-mingle"]


@dataclass
class WorkerProcess:
    name: str  # the first part of its Celery name: its heartbeats are under "{name}@{host}"
    model: str
    started_at: float  # unix time
    pid: int
    log_path: Path | None = None
    stopping_since: float | None = None  # when it was told to stop
    exit_code: int | None = None


class WorkerBackend(Protocol):
    name: str

    def start(self, model: str) -> WorkerProcess: ...

    def stop(self, name: str) -> None: ...

    def workers(self, model: str | None = None) -> list[WorkerProcess]:
        """The workers it started that still run (a stopping one too, until it has exited)."""
        ...

    def reap(self) -> list[WorkerProcess]:
        """The workers that exited since the last call, each with its exit code; no longer listed."""
        ...

    def close(self, timeout: float) -> None:
        """Stop every worker it started and wait up to `timeout` seconds for them to exit (killing
        what is left); reap() then says how each ended."""
        ...


class LocalBackend:
    """Worker processes on this machine. `env_of(model)` is the environment of a model's workers
    (MODEL_PATH, MODEL_NAME and the rest of the settings)."""

    name = "local"

    def __init__(self, env_of: Callable[[str], dict[str, str]], log_dir: Path | None,
                 command: Callable[[str], list[str]] = celery_worker_command):
        self.env_of = env_of
        self.log_dir = log_dir
        self.command = command
        # Names unique on this host while this process lives, so no two workers share a heartbeat.
        self._prefix = f"auto{os.getpid()}"
        self._count = 0
        self._running: dict[str, tuple[WorkerProcess, subprocess.Popen]] = {}

    def start(self, model: str) -> WorkerProcess:
        self._count += 1
        name = f"{self._prefix}-{_slug(model)}-{self._count}"
        log_path = self.log_dir / f"worker-{name}.log" if self.log_dir else None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "a") if log_path else subprocess.DEVNULL
        try:
            # A session of its own: a Ctrl-C at the autoscaler's terminal reaches the autoscaler only,
            # which then stops its workers itself.
            process = subprocess.Popen(self.command(name), cwd=REPO_ROOT, env=self.env_of(model), stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if log_path is not None:
                out.close()
        worker = WorkerProcess(name, model, time.time(), process.pid, log_path)
        self._running[name] = (worker, process)
        return worker

    def stop(self, name: str) -> None:
        worker, process = self._running[name]
        if worker.stopping_since is None:
            worker.stopping_since = time.time()
            _signal(process, signal.SIGTERM)

    def workers(self, model: str | None = None) -> list[WorkerProcess]:
        return [w for w, _ in self._running.values() if model is None or w.model == model]

    def reap(self) -> list[WorkerProcess]:
        exited = []
        for name, (worker, process) in list(self._running.items()):
            code = process.poll()
            if code is not None:
                worker.exit_code = code
                exited.append(worker)
                del self._running[name]
        return exited

    def close(self, timeout: float) -> None:
        for name in list(self._running):
            self.stop(name)
        deadline = time.monotonic() + timeout
        for worker, process in list(self._running.values()):
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker %s did not stop within %.0f s; killing it (the broker redelivers its tasks)",
                            worker.name, timeout)
                _signal(process, signal.SIGKILL)
                process.wait()


def _signal(process: subprocess.Popen, sig: int) -> None:
    try:
        process.send_signal(sig)
    except ProcessLookupError:  # it has just exited; reap() sees it
        pass


def _slug(model: str) -> str:
    """A model name as it may stand in a Celery node name."""
    return re.sub(r"[^A-Za-z0-9_-]+", "_", model)[:40] or "model"
