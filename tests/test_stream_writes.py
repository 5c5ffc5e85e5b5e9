"""The token stream writes of llmq/streams.py on a real Redis: numbered, idempotent, published once."""
from __future__ import annotations

import json
import time

import pytest
import redis

from llmq.events import STEPS_CHANNEL, DoneEvent, Usage, stream_key, tokens_channel
from llmq.streams import EventWrite, publish_events, write_events
from tests.conftest import token_event

MAXLEN = 1000


def entries(redis_db, request_id: str) -> list[tuple[str, str]]:
    return [(entry_id.decode(), fields[b"data"].decode()) for entry_id, fields in redis_db.xrange(stream_key(request_id))]


def published(pubsub) -> list[int]:
    """Token ids of the messages the subscription has received so far."""
    ids, deadline = [], time.monotonic() + 1.0
    while time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.1)
        if message is None:
            if ids:
                break
            continue
        if message["type"] == "message":
            ids.extend(json.loads(message["data"])["token_ids"])
    return ids


def test_events_are_numbered_and_a_repeated_write_lands_once(redis_db):
    pubsub = redis_db.pubsub()
    pubsub.subscribe(tokens_channel("a"))
    pubsub.get_message(timeout=1)  # the subscribe confirmation
    write_events(redis_db, [EventWrite("a", [token_event(1), token_event(2), token_event(3)], first_number=1)], MAXLEN)
    # A retried step (the connection dropped after Redis ran it) overlaps what is there: 2 and 3 again, then 4.
    write_events(redis_db, [EventWrite("a", [token_event(2), token_event(3), token_event(4)], first_number=2)], MAXLEN)
    assert [entry_id for entry_id, _ in entries(redis_db, "a")] == ["0-1", "0-2", "0-3", "0-4"]
    assert published(pubsub) == [1, 2, 3, 4]


def test_number_zero_appends_after_the_last_event(redis_db):
    write_events(redis_db, [EventWrite("b", [token_event(1), token_event(2)], first_number=1)], MAXLEN)
    publish_events(redis_db, "b", [DoneEvent(Usage(0, 0))], MAXLEN, ttl=60)
    assert [entry_id for entry_id, _ in entries(redis_db, "b")] == ["0-1", "0-2", "0-3"]
    assert 0 < redis_db.ttl(stream_key("b")) <= 60
    assert [json.loads(data)["type"] for _, data in entries(redis_db, "b")] == ["delta", "delta", "done"]


def test_many_requests_in_one_call_and_a_redis_without_the_script(redis_db):
    redis_db.script_flush()  # as after a Redis restart: the script is loaded again and the writes sent again
    write_events(redis_db, [EventWrite(f"r{i}", [token_event(i)], first_number=1) for i in range(5)], MAXLEN)
    assert [entries(redis_db, f"r{i}")[0][0] for i in range(5)] == ["0-1"] * 5


def test_a_key_that_is_not_a_stream_is_an_error_not_a_skipped_write(redis_db):
    redis_db.set(stream_key("c"), "not a stream")
    with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
        write_events(redis_db, [EventWrite("c", [token_event(1)], first_number=1)], MAXLEN)


def test_one_call_writes_each_request_at_its_own_number_and_ttl(redis_db):
    write_events(redis_db, [EventWrite("y", [token_event(1)], first_number=1)], MAXLEN)
    write_events(redis_db, [EventWrite("x", [token_event(1), token_event(2)], first_number=1),
                          EventWrite("y", [token_event(2), DoneEvent(Usage(0, 0))], ttl=60),
                          EventWrite("z", [token_event(7)], first_number=7)], MAXLEN)
    assert [entry_id for entry_id, _ in entries(redis_db, "x")] == ["0-1", "0-2"]
    assert [entry_id for entry_id, _ in entries(redis_db, "y")] == ["0-1", "0-2", "0-3"]
    assert [entry_id for entry_id, _ in entries(redis_db, "z")] == ["0-7"]
    assert redis_db.ttl(stream_key("x")) == -1 and 0 < redis_db.ttl(stream_key("y")) <= 60


def test_a_write_caps_its_stream_only_when_it_brings_a_cap(redis_db):
    many = [token_event(i) for i in range(1, 251)]
    write_events(redis_db, [EventWrite("capped", many, first_number=1, maxlen=5),
                            EventWrite("whole", many, first_number=1)], maxlen=None)
    assert redis_db.xlen(stream_key("whole")) == 250
    assert redis_db.xlen(stream_key("capped")) < 250  # MAXLEN ~ drops whole nodes of the stream's start
    publish_events(redis_db, "whole", [DoneEvent(Usage(0, 250))], maxlen=None)  # appending one never trims
    assert redis_db.xlen(stream_key("whole")) == 251


def test_a_large_step_is_written_in_bounded_calls_and_each_stream_stays_whole(redis_db):
    pubsub = redis_db.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(STEPS_CHANNEL)
    big = [token_event(i) for i in range(1, 1001)]
    write_events(redis_db, [EventWrite("big", big, first_number=1, ttl=60),
                            EventWrite("tail", [token_event(1), token_event(2)], first_number=0, ttl=60),
                            EventWrite("small", [token_event(5)], first_number=5)], max_events_per_call=256)
    calls = []
    deadline = time.monotonic() + 5
    while len(calls) < 4 and time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.5)
        if message:
            calls.append(json.loads(message["data"]))
    assert [len(call) for call in calls] == [256, 256, 256, 235]  # 1,003 events, each call at most 256
    assert [entry_id for entry_id, _ in entries(redis_db, "big")] == [f"0-{n}" for n in range(1, 1001)]
    assert [entry_id for entry_id, _ in entries(redis_db, "tail")] == ["0-1", "0-2"]
    assert [entry_id for entry_id, _ in entries(redis_db, "small")] == ["0-5"]
    assert redis_db.ttl(stream_key("big")) > 0 and redis_db.ttl(stream_key("small")) == -1
    pubsub.close()
