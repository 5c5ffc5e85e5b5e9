"""EngineService: one engine per worker, driven by one loop thread that owns the device.

It runs in the worker's engine process (workers/engine_process.py, whose pipe reader hands it jobs
with `submit()`), or with LLMQ_ENGINE_PROCESS=0 in the Celery worker's own process, where task
threads call `run()`: it hands the request to the loop and waits. The loop admits new
requests, aborts cancelled ones, runs `engine.step()`, and hands each step's token deltas to a
StepWriter, which writes them to Redis in one round trip (on a GPU while the next step runs), so
tokens reach streaming clients as they are made. A cancel published on
`llmq:cancel` aborts the request at the next step and frees its KV blocks.

The loop also keeps the worker's metrics: the engine's counters (tokens, prefix cache, preemptions)
and, unless LLMQ_METRICS=0, its requests' timings and endings (workers/request_metrics.py); `stats()`
carries both under "metrics", and so every heartbeat does (llmq/metrics.py).

Those published events are also each request's checkpoint: an EngineRequest's `resume_from` is the
progress read back from the request's stream, and the request goes on from it (a worker died or
handed it back). `hand_back()` ends every request in flight with HandedBack, so a stopping worker
returns its work to the queue at once instead of finishing it.
"""
from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable

from llmq.engine.config import EngineConfig, ResumePoint
from llmq.errors import InvalidRequest
from llmq.events import DeltaEvent, DoneEvent, Event, Usage
from llmq.model.tokenizer import Tokenizer
from llmq.outputs import CompletionOutput, RequestDelta
from workers.job import Job, one_sample, output_so_far
from workers.messages import EngineFailure, EngineRequest, EngineResult, HandedBack, StreamWriteFailure
from workers.publisher import StreamPublisher
from workers.request_metrics import RequestMetrics
from workers.step_writer import StepEvents, StepWriter

if TYPE_CHECKING:  # the engine (and torch) load only in worker processes, not in Flower or the web
    from llmq.engine.llm import LLMEngine

log = logging.getLogger(__name__)


# How long a cancel for a request not (yet) in the engine is remembered: covers the moment between a
# task's cancel check and its request reaching the loop; cancels of finished requests simply expire.
_EARLY_CANCEL_MEMORY_S = 60.0


class EngineService:
    """`engine_factory` builds (loads and warms) the engine on the loop thread itself: the thread that
    first runs torch work owns an OpenMP thread team, and a second team in the process (one made by a
    load on another thread) puts OpenMP into its yield-and-sleep mode on a small machine, which made
    every step of the worker measurably slower than the same step offline.

    `nice`: the loop thread's CPU priority, set before it loads the engine, so the OpenMP threads it
    starts inherit it (LLMQ_ENGINE_NICE, see Settings.resolved_engine_nice). `background_writes`: a thread of
    its own writes each step's events while the next step runs (workers/step_writer.py). `metrics`: keep
    the requests' timings (LLMQ_METRICS, Settings.metrics)."""

    def __init__(self, engine_factory: Callable[[], "LLMEngine"], publisher: StreamPublisher, nice: int = 0,
                 background_writes: bool = False, metrics: bool = True):
        self._engine_factory = engine_factory
        self._nice = nice
        self.engine: "LLMEngine | None" = None
        # Made here, not on the loop thread: its thread keeps this thread's priority.
        self._writer = StepWriter(publisher, background=background_writes)
        self._intake: queue.Queue[Job] = queue.Queue()
        self._cancels: queue.Queue[str] = queue.Queue()
        self._hand_backs: queue.Queue[str] = queue.Queue()
        self._jobs: dict[str, Job] = {}  # by API request id; touched by the loop thread only
        self._by_engine_id: dict[str, Job] = {}
        # Cancels that arrived before their job was admitted (a task between its cancel check and run()).
        self._early_cancels: dict[str, float] = {}
        self._stopping = threading.Event()
        self._handing_back = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="llmq-engine-loop", daemon=True)
        self._stats_lock = threading.Lock()
        self._stats: dict = {}
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._metrics = RequestMetrics() if metrics else None  # changed by the loop thread only

    # ---- called from task threads --------------------------------------------------------

    def start(self) -> None:
        """Start the loop thread; returns once its engine is loaded and warm (raises if loading failed)."""
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout)
        self._writer.stop(timeout)

    def run(self, request: EngineRequest, timeout: float | None = None) -> EngineResult:
        """Generate, publishing tokens as they come; returns when every sample has finished. With
        `request.resume_from`, the choices go on from (and their outputs start with) what it holds.
        Raises InvalidRequest if the engine refuses the request (e.g. longer than the context),
        HandedBack if this worker is stopping."""
        job = Job(request)
        self.submit(job)
        return job.outcome.wait(request.request_id, timeout, self.cancel)

    def submit(self, job: Job) -> None:
        """Hand a job to the loop without waiting: `job.finish()` reports its end (see `run`)."""
        job.arrived_at = time.perf_counter()
        self._intake.put(job)
        self._wake.set()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def hand_back(self, request_id: str | None = None) -> None:
        """Stop taking work: every request in flight, and any that arrives, ends with HandedBack at
        the loop's next turn (their checkpoints are what the last step published). With a request id:
        only that request (another worker has taken it over)."""
        if request_id is None:
            self._handing_back.set()
        else:
            self._hand_backs.put(request_id)
        self._wake.set()

    def cancel(self, request_id: str) -> None:
        """Abort at the next step (thread-safe; unknown or finished ids are ignored)."""
        self._cancels.put(request_id)
        self._wake.set()

    def stats(self) -> dict:
        """The engine's load now (running, waiting, free and total KV blocks), the loop's totals since
        the worker started: steps, busy_seconds (inside engine.step) and tokens generated, and under
        "metrics" the worker's counters and request timings (llmq/metrics.py)."""
        with self._stats_lock:
            stats = dict(self._stats)
        if self.engine is not None:
            metrics = self.engine.counters.as_dict()
            if self._metrics is not None:
                metrics.update(self._metrics.snapshot())
            stats["metrics"] = metrics
        return stats

    # ---- the loop thread -----------------------------------------------------------------

    def _loop(self) -> None:
        try:
            _set_thread_nice(self._nice)
            self.engine = self._engine_factory()
            totals = _Totals()
            self._stats = {**self.engine.stats(), **totals.as_dict()}
            progress = _Progress(totals)
        except BaseException as err:  # reported by start() in the worker's main thread
            self._load_error = err
            return
        finally:
            self._ready.set()
        while not self._stopping.is_set():
            try:
                if (failure := self._writer.failure()) is not None:
                    self._end_all(StreamWriteFailure(f"the request's tokens could not be written to Redis: {failure}"))
                    self._writer.flush()  # the steps still queued are dropped, their finished jobs failed
                    self._writer.clear_failure()
                self._admit()
                if self._handing_back.is_set():
                    self._end_all(HandedBack("this worker is stopping; the request goes back to the queue"))
                self._hand_back_taken_over()
                self._abort()
                if not self.engine.has_unfinished():
                    progress.report(self.engine.stats())
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                started = time.perf_counter()
                deltas = self.engine.step()
                totals.add(time.perf_counter() - started, sum(len(d.token_ids) for d in deltas))
                if self._metrics is not None and self.engine.started:
                    self._record_scheduled(started)
                self._dispatch(deltas)
                with self._stats_lock:
                    self._stats = {**self.engine.stats(), **totals.as_dict()}
                progress.report(self._stats)
            except Exception:  # one bad step must not take the worker down: fail what was in flight
                log.exception("engine step failed; failing the requests in flight")
                self._end_all(EngineFailure("the engine failed while running this request; see the worker log"))
        self.engine.close()  # a parallel engine's other ranks end with it

    def _admit(self) -> None:
        while True:
            try:
                job = self._intake.get_nowait()
            except queue.Empty:
                return
            try:
                self._start(job)
            except Exception as err:  # refused (InvalidRequest) or broken: either way this job ends here
                if not isinstance(err, InvalidRequest):
                    log.exception("could not admit request %s", job.request_id)
                    err = EngineFailure(f"the engine could not take this request: {err}")
                self._end(job, err)  # what _start had added to the engine comes out again
                continue
            if job.finished:  # resumed with every choice already done: only the ending was missing
                events = {}
                if job.request.resume_from.ended_with is None:
                    done = DoneEvent(Usage(job.prompt_tokens, job.completion_tokens), time.time())
                    events = {job.request_id: (job.num_events + 1, [done])}
                self._writer.submit(StepEvents(events, finished=[job]))
                continue
            self._jobs[job.request_id] = job
            if self._metrics is not None:
                self._metrics.arrived(job, job.arrived_at)
            if self._early_cancels.pop(job.request_id, None) is not None:
                self._cancels.put(job.request_id)

    def _start(self, job: Job) -> None:
        """Add a job's prompts to the engine: fresh prompts with their n samples together, choices of
        an interrupted run each on its own, resumed from the tokens it had streamed."""
        request = job.request
        n = request.params.n
        streamed = request.resume_from.choices if request.resume_from else {}
        if request.resume_from is not None:
            job.num_events = request.resume_from.num_events
        if streamed:
            log.info("resuming %s from its checkpoint: %d tokens already generated", job.request_id,
                     request.resume_from.num_tokens)
        for k, prompt in enumerate(request.prompts):
            before = [streamed.get(k * n + s) for s in range(n)]
            if not any(c is not None and (c.token_ids or c.finish_reason) for c in before):
                engine_id = f"{job.request_id}#{k}"
                self.engine.add_request(engine_id, prompt, request.params, request.priority, tenant=request.tenant,
                                        weight=request.weight)
                job.routes[engine_id] = (k, 0)
                job.outputs.append([CompletionOutput(i) for i in range(n)])
            else:
                job.outputs.append([output_so_far(c, s) for s, c in enumerate(before)])
                for s, output in enumerate(job.outputs[k]):
                    if output.finish_reason is None:
                        engine_id = f"{job.request_id}#{k}.{s}"
                        self.engine.add_request(engine_id, prompt, one_sample(request.params, s), request.priority,
                                                resume=ResumePoint(tuple(output.token_ids), len(output.text)),
                                                tenant=request.tenant, weight=request.weight)
                        job.routes[engine_id] = (k, s)
        for engine_id in job.routes:
            self._by_engine_id[engine_id] = job

    def _abort(self) -> None:
        now = time.monotonic()
        while True:
            try:
                request_id = self._cancels.get_nowait()
            except queue.Empty:
                break
            job = self._jobs.get(request_id)
            if job is None:
                self._early_cancels[request_id] = now
                continue
            for engine_id in job.routes:
                self.engine.abort(engine_id)  # the abort deltas come out of the next step
        for request_id, at in list(self._early_cancels.items()):
            if now - at > _EARLY_CANCEL_MEMORY_S:
                del self._early_cancels[request_id]

    def _record_scheduled(self, step_started: float) -> None:
        """The requests the step just run scheduled for the first time: their wait ended as it began."""
        for engine_id in self.engine.started:
            job = self._by_engine_id.get(engine_id)
            if job is not None:
                self._metrics.scheduled(job, step_started)

    def _dispatch(self, deltas: list[RequestDelta]) -> None:
        events: dict[Job, list[Event]] = {}
        finished_jobs = []
        now = time.time()
        metrics = self._metrics
        at = time.perf_counter() if metrics is not None else 0.0
        for delta in deltas:
            job = self._by_engine_id.get(delta.request_id)
            if job is None:
                continue
            prompt_number, first_sample = job.routes[delta.request_id]
            sample = first_sample + delta.index
            job.outputs[prompt_number][sample].add(delta)
            if job.first_token_at is None and delta.token_ids:
                job.first_token_at = now
            choice = prompt_number * job.params.n + sample
            events.setdefault(job, []).append(DeltaEvent(choice, delta.text, delta.token_ids, delta.logprobs,
                                                         delta.finish_reason, now))
            if metrics is not None:
                metrics.delta(job, choice, len(delta.token_ids), delta.finish_reason, at)
            if delta.finished and job.finished:
                finished_jobs.append(job)
        for job in finished_jobs:
            events.setdefault(job, []).append(DoneEvent(Usage(job.prompt_tokens, job.completion_tokens), now))
            if metrics is not None:
                metrics.finished(job, at)
        numbered, lengths = {}, {}
        for job, job_events in events.items():
            numbered[job.request_id] = (job.num_events + 1, job_events)
            lengths[job.request_id] = job.max_events
            job.num_events += len(job_events)
        for job in finished_jobs:
            self._jobs.pop(job.request_id, None)
            for engine_id in job.routes:
                self._by_engine_id.pop(engine_id, None)
        self._writer.submit(StepEvents(numbered, finished=finished_jobs, stream_lengths=lengths))  # wakes them once written

    def _hand_back_taken_over(self) -> None:
        while True:
            try:
                job = self._jobs.get(self._hand_backs.get_nowait())
            except queue.Empty:
                return
            if job is not None:
                self._end(job, HandedBack("another worker has taken this request over"))

    def _end(self, job: Job, error: Exception) -> None:
        """Take a job out of the engine and the loop's tables, and wake its task thread with `error`
        once the events it made are written (a worker that resumes it reads them back)."""
        self._writer.flush()
        for engine_id in job.routes:
            self.engine.abort(engine_id)
            self._by_engine_id.pop(engine_id, None)
        if self._jobs.get(job.request_id) is job:  # a job refused at admission never got in
            del self._jobs[job.request_id]
        if self._metrics is not None:
            self._metrics.forget(job)
        job.finish(error)

    def _end_all(self, error: Exception) -> None:
        """End every job in flight with `error`; their engine requests are aborted, and the abort deltas
        the next step hands out belong to no job any more, so nothing more is published for them."""
        if self._jobs:
            log.warning("ending %d request(s) in flight: %s", len(self._jobs), error)
        for job in list(self._jobs.values()):
            self._end(job, error)


def load_and_warm(config: EngineConfig) -> "LLMEngine":
    """Build the engine and run one tiny request through it, so the first real step pays no one-time
    cost. An EngineService's factory: it runs on the loop thread."""
    from llmq.engine.llm import LLMEngine
    from llmq.sampling_params import SamplingParams

    engine = LLMEngine(config)
    engine.add_request("warmup", "Hello", SamplingParams(temperature=0, max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    engine.counters.reset()  # the warm-up is no work of the worker's
    return engine


def _set_thread_nice(nice: int) -> None:
    """Give the calling thread (and the threads it starts from now on) at least this nice value: one
    that already runs at a higher one (the whole worker started under `nice`) keeps it. Linux keeps
    one per thread; elsewhere the engine keeps the process's priority."""
    if not nice:
        return
    if not sys.platform.startswith("linux"):
        log.info("engine priority (nice %d) not set: per-thread priorities need Linux", nice)
        return
    thread_id = threading.get_native_id()
    current = os.getpriority(os.PRIO_PROCESS, thread_id)
    if current >= nice:
        log.info("engine threads keep the worker's nice value, %d (at least %d was asked)", current, nice)
        return
    try:
        os.setpriority(os.PRIO_PROCESS, thread_id, nice)
    except OSError as err:  # raising priority (a lower nice than the process has) needs privileges
        log.warning("could not set the engine threads' nice value to %d: %s", nice, err)
        return
    log.info("engine threads run at nice %d: the serving threads sharing their CPU cores go first", nice)


class _Totals:
    """The loop's work since the worker started, for heartbeats (GET /v1/workers) and benchmarks."""

    def __init__(self):
        self.steps = self.tokens = 0
        self.busy_seconds = 0.0

    def add(self, seconds: float, tokens: int) -> None:
        self.steps += 1
        self.busy_seconds += seconds
        self.tokens += tokens

    def as_dict(self) -> dict:
        return {"steps": self.steps, "busy_seconds": round(self.busy_seconds, 6), "tokens": self.tokens}


class _Progress:
    """What the engine loop did lately (from its totals), logged every LOG_EVERY_S while it works."""

    LOG_EVERY_S = 10.0

    def __init__(self, totals: _Totals):
        self.totals = totals
        self._mark()

    def _mark(self) -> None:
        self.since = time.monotonic()
        self.start = (self.totals.steps, self.totals.busy_seconds, self.totals.tokens)

    def report(self, stats: dict) -> None:
        elapsed = time.monotonic() - self.since
        steps, busy, tokens = (now - then for now, then in zip((self.totals.steps, self.totals.busy_seconds,
                                                                  self.totals.tokens), self.start))
        if elapsed < self.LOG_EVERY_S or not steps:
            return
        log.info("engine: %d steps (%.1f ms each, busy %.0f%%), %.0f tokens/s; running %d, waiting %d, "
                 "free KV blocks %d/%d", steps, 1000 * busy / steps, 100 * busy / elapsed, tokens / elapsed,
                 stats["running"], stats["waiting"], stats["free_blocks"], stats["total_blocks"])
        self._mark()
