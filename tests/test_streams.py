"""The token stream writes of app/streams.py on a real Redis: numbered, idempotent, published once."""
from __future__ import annotations

import json
import time

import pytest
import redis

from app.streams import EventWrite, publish_events, stream_key, tokens_channel, write_events

MAXLEN = 1000


@pytest.fixture
def client(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()


def delta(k: int) -> dict:
    return {"type": "delta", "index": 0, "text": f"t{k}", "token_ids": [k], "logprobs": None,
            "finish_reason": None, "t": 0.0}


def entries(client, request_id: str) -> list[tuple[str, str]]:
    return [(entry_id.decode(), fields[b"data"].decode()) for entry_id, fields in client.xrange(stream_key(request_id))]


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
            ids.append(int(message["data"].decode().split('"token_ids": [')[1].split("]")[0]))
    return ids


def test_events_are_numbered_and_a_repeated_write_lands_once(client):
    pubsub = client.pubsub()
    pubsub.subscribe(tokens_channel("a"))
    pubsub.get_message(timeout=1)  # the subscribe confirmation
    write_events(client, [EventWrite("a", [delta(1), delta(2), delta(3)], first_number=1)], MAXLEN)
    # A retried step (the connection dropped after Redis ran it) overlaps what is there: 2 and 3 again, then 4.
    write_events(client, [EventWrite("a", [delta(2), delta(3), delta(4)], first_number=2)], MAXLEN)
    assert [entry_id for entry_id, _ in entries(client, "a")] == ["0-1", "0-2", "0-3", "0-4"]
    assert published(pubsub) == [1, 2, 3, 4]


def test_number_zero_appends_after_the_last_event(client):
    write_events(client, [EventWrite("b", [delta(1), delta(2)], first_number=1)], MAXLEN)
    publish_events(client, "b", [{"type": "done", "usage": {}, "t": 0.0}], MAXLEN, ttl=60)
    assert [entry_id for entry_id, _ in entries(client, "b")] == ["0-1", "0-2", "0-3"]
    assert 0 < client.ttl(stream_key("b")) <= 60
    assert [json.loads(data)["type"] for _, data in entries(client, "b")] == ["delta", "delta", "done"]


def test_many_requests_in_one_call_and_a_redis_without_the_script(client):
    client.script_flush()  # as after a Redis restart: the script is loaded again and the writes sent again
    write_events(client, [EventWrite(f"r{i}", [delta(i)], first_number=1) for i in range(5)], MAXLEN)
    assert [entries(client, f"r{i}")[0][0] for i in range(5)] == ["0-1"] * 5


def test_a_key_that_is_not_a_stream_is_an_error_not_a_skipped_write(client):
    client.set(stream_key("c"), "not a stream")
    with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
        write_events(client, [EventWrite("c", [delta(1)], first_number=1)], MAXLEN)


def test_one_call_writes_each_request_at_its_own_number_and_ttl(client):
    write_events(client, [EventWrite("y", [delta(1)], first_number=1)], MAXLEN)
    write_events(client, [EventWrite("x", [delta(1), delta(2)], first_number=1),
                          EventWrite("y", [delta(2), {"type": "done", "usage": {}, "t": 0.0}], ttl=60),
                          EventWrite("z", [delta(7)], first_number=7)], MAXLEN)
    assert [entry_id for entry_id, _ in entries(client, "x")] == ["0-1", "0-2"]
    assert [entry_id for entry_id, _ in entries(client, "y")] == ["0-1", "0-2", "0-3"]
    assert [entry_id for entry_id, _ in entries(client, "z")] == ["0-7"]
    assert client.ttl(stream_key("x")) == -1 and 0 < client.ttl(stream_key("y")) <= 60
