"""StepWriter: the engine loop's token events go to Redis, in order, from a thread of their own
(`background`) or from the loop itself.

Writing a step's events (one script call for every request in it) takes the loop 1-2 ms a step on
the development machine. On a GPU the device idles meanwhile: there the loop hands each step's events
to this writer's thread and starts the next step at once, and the thread writes them while the step
runs. At most `max_pending` steps wait, so a slow or restarting Redis holds the loop back as it did
when the loop wrote them itself. On the CPU the step and the write need the same cores, and
overlapping them only made them compete (about 1 ms more step -> SSE latency on 2 cores, and no
throughput to show for it), so there the loop writes them itself.

Order is what makes this safe. The events are every request's checkpoint and its readers' stream:
- they are written one step after another, as the loop made them;
- a job that finished in a step is woken (`job.finish`) only once that step's events are written, so
  its task stores the result after its stream holds the end;
- the loop calls `flush()` before it ends a job any other way (an error, or handing it back to the
  queue), so another worker that resumes the request finds every token this one made.
A write that fails ends the jobs that finished in its step with StreamWriteFailure and is reported to
the loop (`failure`), which fails the requests still in flight, as a failed write in the loop did
before. Until the loop has done that (`clear_failure`), later steps are not written either: a
request's stream must never skip an event, and its end (the task's error event) is appended after
the last one written.
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field

from llmq.events import Event
from workers.job import Job
from workers.messages import StreamWriteFailure
from workers.publisher import StreamPublisher

log = logging.getLogger(__name__)


@dataclass
class StepEvents:
    """One step's events: request id -> (the number of its first event here, its events)."""

    events: dict[str, tuple[int, list[Event]]]
    finished: list[Job] = field(default_factory=list)  # woken once the events are written
    stream_lengths: dict[str, int] = field(default_factory=dict)  # request id -> the most events it can make


class StepWriter:
    def __init__(self, publisher: StreamPublisher, background: bool, max_pending: int = 2):
        self.publisher = publisher
        self._pending: queue.Queue[StepEvents | None] = queue.Queue(maxsize=max_pending)
        self._failure: BaseException | None = None
        self._failure_lock = threading.Lock()
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._run, name="llmq-step-writer", daemon=True)
            self._thread.start()

    def submit(self, step: StepEvents) -> None:
        """Write a step's events, or queue them for the writer's thread (waiting while `max_pending`
        steps are not written yet)."""
        if self._thread is None:
            self._write(step)
        else:
            self._pending.put(step)

    def flush(self) -> None:
        """Return once every step submitted so far is written (or has failed)."""
        self._pending.join()

    def failure(self) -> BaseException | None:
        """The write failure that stopped this writer, if any."""
        with self._failure_lock:
            return self._failure

    def clear_failure(self) -> None:
        """Write again (the loop has ended every request whose events were dropped)."""
        with self._failure_lock:
            self._failure = None

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread is None:
            return
        try:
            self._pending.put(None, timeout=timeout)
        except queue.Full:  # stuck writing (Redis away): the daemon thread goes with the process
            return
        self._thread.join(timeout)

    def _run(self) -> None:
        while (step := self._pending.get()) is not None:
            try:
                self._write(step)
            finally:
                self._pending.task_done()
        self._pending.task_done()

    def _write(self, step: StepEvents) -> None:
        failed = None  # why the write failed; each job gets an error of its own (its task raises it)
        try:
            if (failure := self.failure()) is not None:
                raise failure
            self.publisher.publish(step.events, finished=[job.request_id for job in step.finished],
                                   stream_lengths=step.stream_lengths)
        except Exception as err:  # Redis gone past its retries: these jobs' ends were not written
            with self._failure_lock:
                if self._failure is None:
                    log.exception("writing a step's token events failed")
                    self._failure = err
            failed = f"the request's last tokens could not be written to Redis: {err}"
        finally:
            for job in step.finished:
                job.finish(StreamWriteFailure(failed) if failed else None)
