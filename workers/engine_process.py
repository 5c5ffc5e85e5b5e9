"""EngineProcess: the worker's EngineService in a process of its own, as vLLM runs its engine core.

In the Celery worker's own process the engine loop shared Python's interpreter lock with everything
else the worker does: the consumer, a hundred task threads writing results through SQLAlchemy,
heartbeats. Every torch call the loop makes gives the lock up and must take it back, so each
millisecond of their Python was a millisecond the loop could wait, and steps ran 5-15 % slower than
the same engine offline. Here the loop runs in a child process with one other thread, which waits on
a pipe; the worker's task threads talk to it through the same EngineClient methods as an EngineService
(`run`, `cancel`, `hand_back`, `stats`, `tokenizer`); the pipe carries workers/messages.py's types.

The child writes the token events to Redis itself (they never cross the pipe); only a job's start
and its end (outputs, token ids, error) do. Its life is bound to the worker's:
  - a worker that is killed takes the child with it (Linux's parent-death signal; elsewhere the
    child ends when the pipe closes), so no engine goes on writing into streams that another worker
    has resumed;
  - a child that dies ends the worker at once (exit code 1): its tasks are unacknowledged, so the
    broker hands them to another worker, which resumes them from their streams;
  - SIGTERM and SIGINT go to the worker, not the child, so a warm shutdown can hand the requests in
    flight back through it (workers/celery_app.py).
"""
from __future__ import annotations

import atexit
import ctypes
import itertools
import logging
import multiprocessing
import os
import signal
import sys
import threading
from dataclasses import dataclass
from functools import partial

from llmq.engine.config import EngineConfig
from llmq.model.tokenizer import Tokenizer
from llmq.redis_client import redis_client
from workers.job import Job, Outcome
from workers.messages import (
    AskStats,
    Cancel,
    EngineRequest,
    EngineResult,
    Finished,
    HandBack,
    LoadFailed,
    Ready,
    Run,
    Stats,
    Stop,
)
from workers.publisher import StreamPublisher
from workers.service import EngineService, load_and_warm

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineOptions:
    """What the child needs to build its engine and publisher (it reads no settings of its own)."""

    engine_config: EngineConfig
    redis_url: str
    redis_retry_seconds: float
    stream_maxlen: int
    stream_ttl: int
    nice: int = 0
    background_writes: bool = False
    log_level: int = logging.INFO
    metrics: bool = True  # the requests' timings (Settings.metrics)


class EngineProcess:
    def __init__(self, options: EngineOptions):
        self.tokenizer = Tokenizer.from_folder(options.engine_config.model)
        self._context = multiprocessing.get_context("spawn")  # never fork a process that has threads
        self._conn, child_conn = self._context.Pipe()
        self._process = self._context.Process(target=_child_main, args=(child_conn, options, os.getpid()),
                                              name="llmq-engine", daemon=True)
        self._child_conn = child_conn
        self._send_lock = threading.Lock()
        self._waiting: dict[int, Outcome] = {}
        self._run_numbers = itertools.count(1)
        self._stats: dict = {}
        self._stats_answered = threading.Condition()
        self._stopping = False

    def start(self) -> None:
        """Start the engine process; returns once its engine is loaded and warm (raises if it failed)."""
        self._process.start()
        self._child_conn.close()  # the child's end: once the child is gone, recv() here sees EOF
        try:
            message = self._conn.recv()
        except EOFError:  # it died without a word (a crash in native code, the OOM killer)
            self._process.join(5)
            raise RuntimeError(f"the engine process exited while loading the model (code "
                               f"{self._process.exitcode}); see the log above") from None
        if isinstance(message, LoadFailed):
            self._process.join(5)
            raise RuntimeError(f"the engine process could not load the model: {message.reason}")
        self._stats = message.stats
        # The child ignores SIGTERM, which multiprocessing's own exit handler would send it and then
        # wait: a worker that exits without stop() stops it first (atexit runs the latest first).
        atexit.register(self.stop)
        threading.Thread(target=self._receive, name="llmq-engine-replies", daemon=True).start()
        log.info("engine process %d is serving", self._process.pid)

    def stop(self, timeout: float = 5.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        try:
            self._send(Stop())
        except OSError:
            pass
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()

    def run(self, request: EngineRequest, timeout: float | None = None) -> EngineResult:
        """As EngineService.run: returns the result; raises what the engine ended the request with."""
        outcome = Outcome()
        number = next(self._run_numbers)
        self._waiting[number] = outcome
        try:
            self._send(Run(number, request))
            return outcome.wait(request.request_id, timeout, self.cancel)
        finally:
            self._waiting.pop(number, None)

    def cancel(self, request_id: str) -> None:
        self._send(Cancel(request_id))

    def hand_back(self, request_id: str | None = None) -> None:
        self._send(HandBack(request_id))

    def stats(self, timeout: float = 5.0) -> dict:
        """The engine's load and the loop's totals (EngineService.stats), asked of the child now."""
        with self._stats_answered:
            before = self._stats
            self._send(AskStats())
            self._stats_answered.wait_for(lambda: self._stats is not before, timeout)
            return dict(self._stats)

    def _send(self, message) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _receive(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, Finished):
                outcome = self._waiting.get(message.number)
                if outcome is not None:
                    outcome.set(message.result, message.error)
            elif isinstance(message, Stats):
                with self._stats_answered:
                    self._stats = message.stats
                    self._stats_answered.notify_all()
        if self._stopping:
            return
        self._process.join(1)
        # Its requests' tasks are still unacknowledged: the broker gives them to another worker, which
        # resumes them from their streams. Failing them here would end them for good.
        log.critical("the engine process exited (code %s); stopping this worker so its requests are "
                     "redelivered", self._process.exitcode)
        logging.shutdown()
        os._exit(1)


# ---- the child process -----------------------------------------------------------------------------

def _die_with_parent(parent_pid: int) -> None:
    """Be killed when the worker dies, however it dies (Linux: PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # it died before the signal was asked for
        os._exit(0)


def _child_main(conn, options: EngineOptions, parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker decides when the engine stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=options.log_level, stream=sys.stderr,
                        format="[%(asctime)s: %(levelname)s/engine %(process)d] %(name)s: %(message)s")
    client = redis_client(options.redis_url, options.redis_retry_seconds)  # rides out a Redis restart
    service = EngineService(partial(load_and_warm, options.engine_config),
                            StreamPublisher(client, options.stream_maxlen, options.stream_ttl),
                            nice=options.nice, background_writes=options.background_writes, metrics=options.metrics)
    send_lock = threading.Lock()

    def send(message) -> None:
        with send_lock:
            conn.send(message)

    try:
        service.start()
    except BaseException as err:
        log.exception("loading the engine failed")
        send(LoadFailed(f"{type(err).__name__}: {err}"))
        return
    send(Ready(service.stats()))
    _serve_parent(conn, service, send)
    service.stop()


def _serve_parent(conn, service: EngineService, send) -> None:
    """Carry out the worker's messages until it says stop or goes away."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the worker is gone
            return
        if isinstance(message, Run):
            job = Job(message.request)
            job.on_done = lambda job, number=message.number: send(
                Finished(number, job.outcome.result, job.outcome.error))
            service.submit(job)
        elif isinstance(message, Cancel):
            service.cancel(message.request_id)
        elif isinstance(message, HandBack):
            service.hand_back(message.request_id)
        elif isinstance(message, AskStats):
            send(Stats(service.stats()))
        elif isinstance(message, Stop):
            return
