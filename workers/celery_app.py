"""The workers' Celery app (`celery -A workers.celery_app worker`), and the worker's start hooks:
the engine is loaded and warmed when the worker starts, before it consumes a task.

The threads pool runs tasks in this process, so every task thread shares the one engine client;
`worker_init` fires in this process before the consumer starts (`worker_process_init` would not:
it belongs to the prefork pool). It builds the WorkerRuntime the tasks are handed
(`celery_app.runtime`, read by workers.tasks through its task class).

A SIGTERM (Celery's warm shutdown; what a spot preemption notice becomes) stops the consumer, and
`worker_shutting_down` hands every request in flight back at once: their tokens are checkpointed in
their streams, so another worker resumes them after one prefill, instead of this one spending the
notice period finishing them while the rest wait. If the handing back itself hangs (a stuck device),
the process exits when the grace period ends, and the broker redelivers its tasks.
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from celery import Celery
from celery.signals import worker_init, worker_shutdown, worker_shutting_down

from llmq.bootstrap import bootstrap
from llmq.celery_config import celery_config
from llmq.protocol.prepare import ServedModel
from llmq.redis_client import redis_client
from llmq.settings import queue_name
from llmq.store.database import Database
from workers import background
from workers.background import Heartbeat
from workers.capacity import Admission, CapacityGate
from workers.engine_client import EngineClient
from workers.held_work import HeldWork
from workers.leases import Leases
from workers.publisher import StreamPublisher
from workers.runtime import WorkerRuntime
from workers.tenant_intake import TenantIntake
from workers.work import Work

# llmq's own loggers (the engine's memory budget, resumed requests, the loop's progress) at INFO:
# Celery leaves the root logger alone (worker_hijack_root_logger is off), and the engine process
# logs at the level found here.
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
settings = bootstrap()
celery_app = Celery("llmq")
celery_app.config_from_object(celery_config(settings))
celery_app.conf.update(worker_pool="threads", worker_concurrency=settings.resolved_worker_threads())
celery_app.runtime = None  # a WorkerRuntime once the worker has started (start_engine)
celery_app.steps["consumer"].add(CapacityGate)  # takes tasks only as the engine has room (workers/capacity.py)

import workers.tasks  # noqa: E402,F401  (registers the tasks)

log = logging.getLogger(__name__)
_stop = threading.Event()
_STARTED_AT = time.time()  # the process start, as near as this module can tell: heartbeats report it
_heartbeat: Heartbeat | None = None


@worker_init.connect
def start_engine(sender=None, **_):
    """Load the model, warm it up, and start the engine loop, heartbeats, sweeper and cancel listener."""
    global _heartbeat
    client = redis_client(settings.redis_url, settings.redis_retry_seconds)
    publisher = StreamPublisher(client, settings.stream_maxlen, settings.stream_ttl)
    name = getattr(sender, "hostname", None) or "worker"
    instance = f"{name}:{secrets.token_hex(4)}"  # this run: a restart under the same name is another
    _heartbeat = Heartbeat(client, settings, name, instance, _STARTED_AT)
    background.start_heartbeats(_heartbeat, _stop)  # "starting", while the model loads
    try:
        engine = _engine_client(publisher)
        engine.start()
    except Exception:
        # Celery logs what a worker_init handler raises and starts consuming anyway: a worker with no
        # engine would take tasks it cannot run. SystemExit is not caught there: the worker exits.
        log.critical("the engine could not start; this worker exits", exc_info=True)
        _stop.set()  # its "starting" heartbeat goes with it
        raise SystemExit(1) from None
    model_name = settings.resolved_model_name()
    admission = Admission()
    intake = TenantIntake(client, model_name, settings.resolved_worker_threads(), settings.resolved_tenant_threads(),
                          settings.tenant_weight, partial(_send_parked, queue_name(model_name)),
                          saturated=lambda: admission.saturated)
    runtime = WorkerRuntime(settings=settings, db=Database(settings.database_url), redis=client,
                            publisher=publisher, engine=engine,
                            model=ServedModel.of_settings(settings),
                            leases=Leases(client, instance, settings.lease_seconds), intake=intake, name=name,
                            instance=instance, held=HeldWork(client, instance, queue_name(model_name)),
                            admission=admission,
                            background=ThreadPoolExecutor(2, thread_name_prefix="llmq-bookkeeping"))
    celery_app.runtime = runtime
    background.start(runtime, celery_app, _stop)
    _heartbeat.ready_at = time.time()
    _heartbeat.runtime = runtime
    log.info("worker %s serving %s from %s (quantization %s); ready %.1f s after its process started", name,
             settings.resolved_model_name(), settings.model_path, settings.quantization or "none",
             _heartbeat.ready_at - _STARTED_AT)


def _send_parked(queue: str, work: Work) -> None:
    celery_app.send_task(work.task, args=[work.arg], queue=queue, priority=work.priority)


def _engine_client(publisher: StreamPublisher) -> EngineClient:
    """The engine in a process of its own (the default), or in this one (LLMQ_ENGINE_PROCESS=0)."""
    if settings.engine_process:
        from workers.engine_process import EngineOptions, EngineProcess

        return EngineProcess(EngineOptions(
            settings.engine_config(), settings.redis_url, settings.redis_retry_seconds, settings.stream_maxlen,
            settings.stream_ttl, settings.resolved_engine_nice(), settings.resolved_background_stream_writes(),
            logging.getLogger().getEffectiveLevel(), metrics=settings.metrics))
    from workers.service import EngineService, load_and_warm

    return EngineService(partial(load_and_warm, settings.engine_config()), publisher,
                         nice=settings.resolved_engine_nice(),
                         background_writes=settings.resolved_background_stream_writes(), metrics=settings.metrics)


@worker_shutting_down.connect
def hand_back_work(sig=None, **_):
    """SIGTERM or SIGINT: hand every request in flight back to the queue, within the grace period."""
    log.warning("worker stopping (%s): handing its requests back to the queue", sig)
    if celery_app.runtime is None:  # stopped before the engine was up
        return
    _heartbeat.draining = True
    try:
        _heartbeat.send()  # at once: the fleet sends it nothing more
    except Exception as err:
        log.warning("could not report draining: %s", err)
    celery_app.runtime.engine.hand_back()
    grace = settings.shutdown_grace_seconds
    watchdog = threading.Timer(grace, _exit_after_grace, args=(grace,))
    watchdog.daemon = True
    watchdog.start()


def _exit_after_grace(grace: float) -> None:
    log.error("the worker did not stop within its %d s grace period; exiting (the broker redelivers "
              "its unfinished tasks)", grace)
    os._exit(1)


@worker_shutdown.connect
def stop_engine(**_):
    _stop.set()
    if celery_app.runtime is not None:
        celery_app.runtime.engine.stop()
