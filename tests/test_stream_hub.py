"""The web's stream reader (app/stream_hub.py) on a real Redis: every reader gets its stream's events
in order, once, from its own position; all of them share one blocked XREAD; a new reader is served at
once; the thread ends when no one reads."""
from __future__ import annotations

import threading
import time

from app.stream_hub import StreamHub, _Reader
from app.streams import EventWrite, stream_key, write_events
from tests.conftest import token_event

MAXLEN = 1000


DONE = {"type": "done", "usage": {}, "t": 0.0}


def write(redis_db, request_id: str, first: int, events: list[dict]) -> None:
    write_events(redis_db, [EventWrite(request_id, events, first_number=first)], MAXLEN)


def collect(hub: StreamHub, request_id: str, out: list, last_id: str = "0-0") -> threading.Thread:
    """Read a stream to its end on a thread (as a web request would), its (id, event) pairs into `out`."""
    def read():
        out.extend((entry_id, event) for entry_id, event in hub.read_events(request_id, last_id) if event is not None)
    thread = threading.Thread(target=read)
    thread.start()
    return thread


def blocked_xreads(redis_db) -> int:
    return sum(1 for c in redis_db.client_list() if c.get("cmd") == "xread" and "b" in c.get("flags", ""))


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
    assert [event.get("token_ids") for _, event in got] == [[1], [2], [3], [4], None]


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


def test_many_readers_share_one_blocked_read(redis_db):
    hub = StreamHub(redis_db)
    results = {f"r{i}": [] for i in range(20)}
    readers = [collect(hub, request_id, out) for request_id, out in results.items()]
    time.sleep(0.5)
    assert blocked_xreads(redis_db) == 1  # not 20 connections, one per reader
    for step in range(1, 4):
        write_events(redis_db, [EventWrite(request_id, [token_event(step)], first_number=step) for request_id in results], MAXLEN)
    write_events(redis_db, [EventWrite(request_id, [DONE], first_number=4) for request_id in results], MAXLEN)
    for reader in readers:
        reader.join(10)
    assert all([e.get("token_ids") for _, e in out] == [[1], [2], [3], None] for out in results.values())


def test_a_new_reader_wakes_the_hub_instead_of_waiting_out_its_block(redis_db):
    hub = StreamHub(redis_db, block_ms=30_000)
    first, second = [], []
    readers = [collect(hub, "c1", first)]
    time.sleep(0.3)  # the hub is now blocked for 30 s on c1 alone
    write(redis_db, "c2", 1, [token_event(1), DONE])
    started = time.monotonic()
    readers.append(collect(hub, "c2", second))
    readers[1].join(10)
    assert [e["type"] for _, e in second] == ["delta", "done"]
    assert time.monotonic() - started < 10, "the second reader waited for the first reader's block to end"
    write(redis_db, "c1", 1, [DONE])
    readers[0].join(10)
    assert [e["type"] for _, e in first] == ["done"]


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
    assert [e["type"] for _, e in hub.read_events("later") if e is not None] == ["done"]


def test_a_reader_behind_the_read_waits_for_a_read_from_its_own_position(redis_db):
    # A reader that joins while the hub reads from further on (another reader's position) must not be
    # handed that read's entries: it would skip the ones between its position and the read's.
    hub = StreamHub(redis_db)
    ahead, behind = _Reader(stream_key("d"), "0-7"), _Reader(stream_key("d"), "0-5")
    hub._readers[stream_key("d")] = {ahead, behind}
    handed = hub._hand_over(stream_key("d"), [("0-8", b"{}"), ("0-9", b"{}")], read_after="0-7")
    assert [(reader, [entry_id for entry_id, _ in fresh]) for reader, fresh in handed] == [(ahead, ["0-8", "0-9"])]
    assert ahead.last_id == "0-9" and behind.last_id == "0-5"
    handed = hub._hand_over(stream_key("d"), [(f"0-{n}", b"{}") for n in range(6, 10)], read_after="0-5")
    assert [(reader, [entry_id for entry_id, _ in fresh]) for reader, fresh in handed] == [
        (behind, ["0-6", "0-7", "0-8", "0-9"])]  # the one ahead has these already
