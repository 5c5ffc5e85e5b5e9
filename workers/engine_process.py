"""EngineProcess: the worker's EngineService in a process of its own, as vLLM runs its engine core.

In the Celery worker's own process the engine loop shared Python's interpreter lock with everything
else the worker does: the consumer, a hundred task threads writing results through SQLAlchemy,
heartbeats. Every torch call the loop makes gives the lock up and must take it back, so each
millisecond of their Python was a millisecond the loop could wait, and steps ran 5-15 % slower than
the same engine offline. Here the loop runs in a child process with one other thread, which waits on
a pipe; the worker's task threads talk to it through the same methods as an EngineService (`run`,
`cancel`, `hand_back`, `stats`, `tokenizer`, `publisher`).

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

from app import redis_client
from app.streams import StreamProgress
from workers.engine.config import InvalidRequest, SamplingParams
from workers.job import EngineFailure, Job
from workers.model.tokenizer import Tokenizer
from workers.publisher import StreamPublisher
from workers.service import EngineService, HandedBack, load_and_warm

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineOptions:
    """What the child needs to build its engine and publisher (it reads no settings of its own)."""

    model_path: str
    engine_options: dict
    redis_url: str
    redis_retry_seconds: float
    stream_maxlen: int
    stream_ttl: int
    nice: int = 0
    background_writes: bool = False
    log_level: int = logging.INFO


class EngineProcess:
    def __init__(self, options: EngineOptions, publisher: StreamPublisher):
        self.publisher = publisher  # the worker's own, for the events its task threads write
        self.tokenizer = Tokenizer.from_folder(options.model_path)
        self._context = multiprocessing.get_context("spawn")  # never fork a process that has threads
        self._conn, child_conn = self._context.Pipe()
        self._process = self._context.Process(target=_child_main, args=(child_conn, options, os.getpid()),
                                              name="llmq-engine", daemon=True)
        self._child_conn = child_conn
        self._send_lock = threading.Lock()
        self._waiting: dict[int, Job] = {}
        self._run_numbers = itertools.count(1)
        self._stats: dict = {}
        self._stats_answered = threading.Condition()
        self._stopping = False

    def start(self) -> None:
        """Start the engine process; returns once its engine is loaded and warm (raises if it failed)."""
        self._process.start()
        self._child_conn.close()  # the child's end: once the child is gone, recv() here sees EOF
        try:
            kind, payload = self._conn.recv()
        except EOFError:  # it died without a word (a crash in native code, the OOM killer)
            self._process.join(5)
            raise RuntimeError(f"the engine process exited while loading the model (code "
                               f"{self._process.exitcode}); see the log above") from None
        if kind != "ready":
            self._process.join(5)
            raise RuntimeError(f"the engine process could not load the model: {payload}")
        self._stats = payload
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
            self._send(("stop",))
        except OSError:
            pass
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()

    def run(self, request_id: str, prompts: list, params: SamplingParams, timeout: float | None = None,
            resume_from: StreamProgress | None = None, priority: int = 0) -> Job:
        """As EngineService.run: returns the finished job; raises what the engine ended it with."""
        job = Job(request_id, prompts, params, resume_from, priority)
        number = next(self._run_numbers)
        self._waiting[number] = job
        try:
            self._send(("run", number, request_id, prompts, params, resume_from, priority))
            return job.result(timeout, self.cancel)
        finally:
            self._waiting.pop(number, None)

    def cancel(self, request_id: str) -> None:
        self._send(("cancel", request_id))

    def hand_back(self, request_id: str | None = None) -> None:
        self._send(("hand_back", request_id))

    def stats(self, timeout: float = 5.0) -> dict:
        """The engine's load and the loop's totals (EngineService.stats), asked of the child now."""
        with self._stats_answered:
            before = self._stats
            self._send(("stats",))
            self._stats_answered.wait_for(lambda: self._stats is not before, timeout)
            return dict(self._stats)

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _receive(self) -> None:
        while True:
            try:
                kind, *payload = self._conn.recv()
            except (EOFError, OSError):
                break
            if kind == "done":
                number, outputs, prompt_token_ids, first_token_at, error = payload
                job = self._waiting.get(number)
                if job is not None:
                    job.outputs, job.prompt_token_ids, job.first_token_at = outputs, prompt_token_ids, first_token_at
                    job.finish(_error_from(error))
            elif kind == "stats":
                with self._stats_answered:
                    self._stats = payload[0]
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


def _error_as_message(error: Exception | None) -> tuple | None:
    """An error a job ended with, as plain data (exception classes' arguments do not all pickle back)."""
    if error is None:
        return None
    return type(error).__name__, str(error), getattr(error, "param", None)


def _error_from(message: tuple | None) -> Exception | None:
    if message is None:
        return None
    kind, text, param = message
    if kind == "InvalidRequest":
        return InvalidRequest(text, param)
    if kind == "HandedBack":
        return HandedBack(text)
    return EngineFailure(text)


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
    service = EngineService(partial(load_and_warm, options.model_path, options.engine_options),
                            StreamPublisher(client, options.stream_maxlen, options.stream_ttl),
                            nice=options.nice, background_writes=options.background_writes)
    send_lock = threading.Lock()

    def send(message: tuple) -> None:
        with send_lock:
            conn.send(message)

    try:
        service.start()
    except BaseException as err:
        log.exception("loading the engine failed")
        send(("failed", f"{type(err).__name__}: {err}"))
        return
    send(("ready", service.stats()))
    _serve_parent(conn, service, send)
    service.stop()


def _serve_parent(conn, service, send) -> None:
    """Carry out the worker's messages until it says stop or goes away."""
    while True:
        try:
            kind, *payload = conn.recv()
        except (EOFError, OSError):  # the worker is gone
            return
        if kind == "run":
            number, request_id, prompts, params, resume_from, priority = payload
            job = Job(request_id, prompts, params, resume_from, priority)
            job.on_done = lambda job, number=number: send(
                ("done", number, job.outputs, job.prompt_token_ids, job.first_token_at, _error_as_message(job.error)))
            service.submit(job)
        elif kind == "cancel":
            service.cancel(payload[0])
        elif kind == "hand_back":
            service.hand_back(payload[0])
        elif kind == "stats":
            send(("stats", service.stats()))
        elif kind == "stop":
            return
