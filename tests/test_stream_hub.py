"""The web's stream reader (app/stream_hub.py) on a real Redis: every reader gets its stream's events
in order, once, from its own position; all of them share one subscription; an event missed on the
channel is read from the stream; a new reader is served at once; the thread ends when no one reads."""
from __future__ import annotations

import threading
import time

import pytest

from app.stream_hub import StreamHub, _Reader
from llmq import events
from llmq.events import STEPS_CHANNEL, DoneEvent, Usage, stream_key
from llmq.streams import EventWrite, write_events
from tests.conftest import token_event

MAXLEN = 1000


DONE = DoneEvent(Usage(0, 0))


@pytest.fixture(autouse=True)
def hubs_end_after_each_test(monkeypatch, redis_db):
    """Each test's hub ends soon after its last reader (before the test's Redis client closes), so the next
    test counts its own subscribers only."""
    monkeypatch.setattr(StreamHub, "IDLE_EXIT_S", 0.2)
    yield
    for channel in redis_db.pubsub_channels("llmq:web-wake:*"):  # a hub blocked for long wakes to end
        redis_db.publish(channel, b"")
    deadline = time.monotonic() + 5
    while any(t.name == "llmq-stream-hub" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)


def write(redis_db, request_id: str, first: int, events: list[dict]) -> None:
    write_events(redis_db, [EventWrite(request_id, events, first_number=first)], MAXLEN)


def collect(hub: StreamHub, request_id: str, out: list, last_id: str = "0-0") -> threading.Thread:
    """Read a stream to its end on a thread (as a web request would), its (id, event) pairs into `out`."""
    def read():
        out.extend((entry_id, event) for entry_id, event in hub.read_events(request_id, last_id) if event is not None)
    thread = threading.Thread(target=read)
    thread.start()
    return thread


def subscribers(redis_db) -> int:
    return dict(redis_db.pubsub_numsub(STEPS_CHANNEL))[STEPS_CHANNEL.encode()]


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_events_before_and_after_joining_arrive_in_order_once(redis_db):
    hub = StreamHub(redis_db)
    write(redis_db, "a", 1, [token_event(1), token_event(2)])
    got = []
    reader = collect(hub, "a", got)
    time.sleep(0.2)
    write(redis_db, "a", 3, [token_event(3)])
    write(redis_db, "a", 3, [token_event(3), token_event(4)])  # a retried write: 3 is there already
    write(redis_db, "a", 5, [DONE])
    reader.join(10)
    assert [entry_id for entry_id, _ in got] == ["0-1", "0-2", "0-3", "0-4", "0-5"]
    assert [getattr(event, "token_ids", None) for _, event in got] == [(1,), (2,), (3,), (4,), None]


def test_readers_at_different_positions_each_get_their_own_rest(redis_db):
    hub = StreamHub(redis_db)
    write(redis_db, "b", 1, [token_event(1), token_event(2), token_event(3)])
    whole, rest = [], []
    readers = [collect(hub, "b", whole), collect(hub, "b", rest, last_id="0-2")]
    time.sleep(0.2)
    write(redis_db, "b", 4, [token_event(4), DONE])
    for reader in readers:
        reader.join(10)
    assert [entry_id for entry_id, _ in whole] == ["0-1", "0-2", "0-3", "0-4", "0-5"]
    assert [entry_id for entry_id, _ in rest] == ["0-3", "0-4", "0-5"]


def test_many_readers_share_one_subscription(redis_db):
    hub = StreamHub(redis_db)
    results = {f"r{i}": [] for i in range(20)}
    readers = [collect(hub, request_id, out) for request_id, out in results.items()]
    time.sleep(0.5)
    assert subscribers(redis_db) == 1  # not 20 connections, one per reader
    for step in range(1, 4):
        write_events(redis_db, [EventWrite(request_id, [token_event(step)], first_number=step) for request_id in results], MAXLEN)
    write_events(redis_db, [EventWrite(request_id, [DONE], first_number=4) for request_id in results], MAXLEN)
    for reader in readers:
        reader.join(10)
    assert all([getattr(e, "token_ids", None) for _, e in out] == [(1,), (2,), (3,), None] for out in results.values())


def test_a_new_reader_wakes_the_hub_instead_of_waiting_out_its_block(redis_db):
    hub = StreamHub(redis_db, block_ms=30_000)
    first, second = [], []
    readers = [collect(hub, "c1", first)]
    time.sleep(0.3)  # the hub is now blocked for 30 s on c1 alone
    write(redis_db, "c2", 1, [token_event(1), DONE])
    started = time.monotonic()
    readers.append(collect(hub, "c2", second))
    readers[1].join(10)
    assert [e.type for _, e in second] == ["delta", "done"]
    assert time.monotonic() - started < 10, "the second reader waited for the first reader's block to end"
    write(redis_db, "c1", 1, [DONE])
    readers[0].join(10)
    assert [e.type for _, e in first] == ["done"]


def test_idle_readers_hear_heartbeats_and_the_thread_ends_when_no_one_reads(redis_db, monkeypatch):
    monkeypatch.setattr(StreamHub, "IDLE_EXIT_S", 0.3)
    hub = StreamHub(redis_db, block_ms=100)
    items = list(hub.read_events("quiet", idle_s=0.1, timeout=0.35))
    assert items and all(item == (None, None) for item in items)
    deadline = time.monotonic() + 5
    while hub._thread is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hub._thread is None
    write(redis_db, "later", 1, [DONE])  # a reader after that starts a thread again
    assert [e.type for _, e in hub.read_events("later") if e is not None] == ["done"]


def test_an_event_missed_on_the_channel_is_read_from_the_stream(redis_db):
    # Event 2 reaches the stream without its message (as when the subscription was down when it was
    # published): event 3's message shows the gap, and the reader gets 2 from the stream, then 3, once.
    hub = StreamHub(redis_db)
    write(redis_db, "e", 1, [token_event(1)])
    got = []
    reader = collect(hub, "e", got)
    wait_for(lambda: len(got) == 1)
    redis_db.xadd(stream_key("e"), {"data": events.encode(token_event(2))}, id="0-2")
    write(redis_db, "e", 3, [token_event(3), DONE])
    reader.join(10)
    assert [entry_id for entry_id, _ in got] == ["0-1", "0-2", "0-3", "0-4"]


def test_after_its_connection_drops_the_hub_reads_what_it_missed(redis_db):
    hub = StreamHub(redis_db)
    got = []
    reader = collect(hub, "f", got)
    wait_for(lambda: subscribers(redis_db) == 1)
    write(redis_db, "f", 1, [token_event(1)])
    wait_for(lambda: len(got) == 1)
    redis_db.client_kill_filter(_type="pubsub")
    write(redis_db, "f", 2, [token_event(2), DONE])  # published with no one subscribed
    reader.join(10)
    assert [entry_id for entry_id, _ in got] == ["0-1", "0-2", "0-3"]


def test_a_step_goes_to_the_readers_it_continues_and_the_others_read_their_stream(redis_db):
    # Routing one step's message: a reader whose next event it holds gets it; one behind (a gap) or
    # not yet caught up (it just joined) gets nothing from it and is left for a read of its stream.
    hub = StreamHub(redis_db)
    key = stream_key("g")
    at_7, at_5, joined = _Reader("g", "0-7"), _Reader("g", "0-5"), _Reader("g", "0-7")
    at_7.caught_up = at_5.caught_up = True
    hub._readers[key] = {at_7, at_5, joined}
    handed = {}
    eighth, ninth = events.to_dict(token_event(8)), events.to_dict(token_event(9))
    hub._route([[key, 8, eighth], [key, 9, ninth], [stream_key("other"), 1, eighth]], handed)
    assert handed == {at_7: [("0-8", token_event(8)), ("0-9", token_event(9))]}
    assert (at_7.last_id, at_7.caught_up) == ("0-9", True)
    assert (at_5.last_id, at_5.caught_up) == ("0-5", False)
    assert (joined.last_id, joined.caught_up) == ("0-7", False)
    handed = {}
    hub._route([[key, 9, ninth]], handed)  # a repeat of what it has
    assert handed == {} and at_7.caught_up


@pytest.mark.parametrize("last_id, expected", [
    ("0-0", "events 1 to 5"),  # from the start: the stream's start is gone
    ("0-4", "event 5"),
])
def test_a_replay_that_cannot_be_whole_says_so(redis_db, last_id, expected):
    write(redis_db, "trimmed", 1, [token_event(i) for i in range(1, 10)] + [DONE])
    redis_db.xtrim(stream_key("trimmed"), minid="0-6", approximate=False)  # as Redis evicting or trimming its start would
    got = []
    collect(StreamHub(redis_db), "trimmed", got, last_id).join(10)
    [(entry_id, event)] = got
    assert entry_id is None and event.code == "stream_incomplete"
    assert expected in event.message and "GET /v1/requests/trimmed" in event.message


def test_a_replay_from_what_the_stream_still_holds_is_whole(redis_db):
    write(redis_db, "trimmed-later", 1, [token_event(i) for i in range(1, 10)] + [DONE])
    redis_db.xtrim(stream_key("trimmed-later"), minid="0-6", approximate=False)
    got = []
    collect(StreamHub(redis_db), "trimmed-later", got, "0-5").join(10)
    assert [entry_id for entry_id, _ in got] == ["0-6", "0-7", "0-8", "0-9", "0-10"]

