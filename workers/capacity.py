"""Work by capacity: a worker takes a request from the broker only when its engine can run it soon.

A Celery worker takes tasks up to its prefetch limit, which by default is its thread count: a worker
that started first would hold the whole of a batch's waiting lines while a worker that joins later
finds the queue empty. So the limit follows the engine instead (`admission_limit`): room for
`max_num_seqs` requests and a little headroom (so the next request is already there when one
finishes); while the engine's own queue is longer than that headroom or its KV cache is nearly full
(saturated), one task at a time, which runs only if its tenant has nothing on this worker yet (the
tenant intake parks it otherwise). What the worker does not take stays in the queue for a worker
that has room.

`CapacityGate` is a consumer bootstep (Celery's documented way to extend the worker): a thread of
its own reads the engine's load a few times a second and sets the consumer's prefetch limit (the
broker QoS), which the consumer's event loop applies on its next turn.
"""
from __future__ import annotations

import logging
import math
import threading

from celery import bootsteps

log = logging.getLogger(__name__)

KV_RESERVE = 0.02  # the share of the KV cache kept free before a worker takes more: room for what runs to grow
GATE_INTERVAL_S = 0.25


def headroom(max_num_seqs: int) -> int:
    """Requests a worker takes beyond max_num_seqs, so its engine has the next one at hand."""
    return max(1, max_num_seqs // 8)


def is_saturated(stats: dict, max_num_seqs: int) -> bool:
    """Whether the engine has more than it can run soon: its own queue longer than the headroom, or
    its KV cache nearly full."""
    total = stats.get("total_blocks") or 0
    kv_tight = total > 0 and stats.get("free_blocks", 0) < math.ceil(KV_RESERVE * total)
    return kv_tight or stats.get("waiting", 0) > headroom(max_num_seqs)


def admission_limit(stats: dict, max_num_seqs: int, held: int) -> int:
    """How many requests (tasks) the worker may hold now, given its engine's `stats` (running,
    waiting, free_blocks, total_blocks) and the `held` tasks it runs. A saturated engine takes one
    task at a time beyond what it holds: the tenant intake parks it unless its tenant has nothing
    here yet (workers/tenant_intake.py), so the queue behind a flood keeps moving, and another
    tenant's request still reaches the engine's fair share. Never below 1 (the broker reads 0 as no
    limit)."""
    if is_saturated(stats, max_num_seqs):
        return held + 1
    return max(1, held, max_num_seqs + headroom(max_num_seqs))


def capacity(stats: dict, max_num_seqs: int, held: int) -> int:
    """How many more requests the worker takes now (its heartbeat says so): none while saturated."""
    if is_saturated(stats, max_num_seqs):
        return 0
    return max(0, admission_limit(stats, max_num_seqs, held) - held)


class Admission:
    """The gate's latest verdict, which the tenant intake reads as each task starts."""

    def __init__(self):
        self.saturated = False


class CapacityGate(bootsteps.StartStopStep):
    """Keeps the consumer's prefetch limit at `admission_limit` (see the module docstring)."""

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent, **kwargs):
        super().__init__(parent, **kwargs)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tick = None

    def start(self, c) -> None:
        runtime = getattr(c.app, "runtime", None)
        if runtime is None:  # no engine in this process: nothing to gate on
            return
        self._stop.clear()
        try:  # before the consumer's first fetch, which would otherwise take up to the thread count
            c.qos.set(admission_limit(runtime.engine.stats(), runtime.settings.max_num_seqs, runtime.held.held()))
        except Exception as err:
            log.warning("capacity gate: no engine stats at start (%s); the first limit waits for them", err)
        self._thread = threading.Thread(target=self._follow, args=(c, runtime), daemon=True, name="llmq-capacity")
        self._thread.start()
        # The event loop applies a changed limit on its next turn; this entry makes sure one comes soon.
        self._tick = c.timer.call_repeatedly(GATE_INTERVAL_S, _no_op, priority=10)

    def stop(self, c) -> None:
        self._stop.set()
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None

    def _follow(self, c, runtime) -> None:
        max_num_seqs = runtime.settings.max_num_seqs
        current = None
        while not self._stop.wait(GATE_INTERVAL_S):
            try:
                stats = runtime.engine.stats()
                runtime.admission.saturated = is_saturated(stats, max_num_seqs)
                limit = admission_limit(stats, max_num_seqs, runtime.held.held())
            except Exception as err:  # the engine is stopping, or did not answer in time: keep the limit
                log.debug("capacity gate: no engine stats (%s)", err)
                continue
            if limit != current and c.qos is not None:
                c.qos.value = limit
                current = limit


def _no_op() -> None:
    pass
