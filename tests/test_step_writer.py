"""The engine loop's step writer (workers/step_writer.py) on a real Redis, writing from its own thread
and from the caller's: steps are written in order, a finished job is woken only once its end is in
its stream, and after a failed write no later step is written until the loop has dealt with it, so no
stream ever skips an event."""
from __future__ import annotations

import pytest
import redis

from llmq.events import DoneEvent, Usage, stream_key
from llmq.sampling_params import SamplingParams
from tests.conftest import token_event
from workers.job import Job
from workers.messages import EngineFailure, EngineRequest
from workers.publisher import StreamPublisher
from workers.step_writer import StepEvents, StepWriter

DONE = DoneEvent(Usage(0, 0))


def job(request_id: str) -> Job:
    return Job(EngineRequest(request_id, prompts=[[1]], params=SamplingParams()))


def event_ids(redis_db, request_id: str) -> list[str]:
    return [entry_id.decode() for entry_id, _ in redis_db.xrange(stream_key(request_id))]


@pytest.mark.parametrize("background", [True, False])
def test_steps_are_written_in_order_and_a_job_wakes_after_its_end_is_written(redis_db, background):
    writer = StepWriter(StreamPublisher(redis_db, maxlen=100, ttl=60), background)
    finishing = job("w1")
    for step in range(1, 4):
        writer.submit(StepEvents({"w1": (step, [token_event(step)]), "w2": (step, [token_event(step)])}))
    writer.submit(StepEvents({"w1": (4, [DONE])}, finished=[finishing]))
    assert finishing.outcome.done(10)
    assert event_ids(redis_db, "w1") == ["0-1", "0-2", "0-3", "0-4"]  # the end is there when it wakes
    assert finishing.outcome.error is None
    writer.flush()
    assert event_ids(redis_db, "w2") == ["0-1", "0-2", "0-3"]
    assert redis_db.ttl(stream_key("w1")) > 0 and redis_db.ttl(stream_key("w2")) == -1  # only the finished expires
    writer.stop()


@pytest.mark.parametrize("background", [True, False])
def test_after_a_failed_write_nothing_is_written_until_the_failure_is_cleared(redis_db, background):
    gone = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)  # nothing listens there
    publisher = StreamPublisher(gone, maxlen=100, ttl=60)
    writer = StepWriter(publisher, background)
    first, second = job("f1"), job("f2")
    writer.submit(StepEvents({"f1": (1, [token_event(1)])}, finished=[first]))
    assert first.outcome.done(10)
    assert isinstance(first.outcome.error, EngineFailure) and writer.failure() is not None
    publisher.client = redis_db  # Redis is back, but the loop has not ended the requests in flight yet
    writer.submit(StepEvents({"f2": (2, [token_event(2)])}, finished=[second]))
    writer.flush()
    assert isinstance(second.outcome.error, EngineFailure) and event_ids(redis_db, "f2") == []  # "0-1" was never written
    writer.clear_failure()
    writer.submit(StepEvents({"f3": (1, [token_event(1)])}))
    writer.flush()
    assert writer.failure() is None and event_ids(redis_db, "f3") == ["0-1"]
    writer.stop()
