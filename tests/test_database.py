"""SQLite's write lock as llmq takes it (llmq/store/database.py): a writer of another process waits its
turn while one holds the lock, then writes, and readers never wait; the threads of one process take
their turns in the process, so none fails or sleeps behind another; a request's row marked running
beside its run never overwrites a later status."""
from __future__ import annotations

import shutil
import threading
import time
from types import SimpleNamespace

import pytest

from llmq.store.database import Database
from llmq.store.models import Request, RequestStatus
from workers.tasks import _mark_running


@pytest.fixture
def url(tmp_path, migrated_db) -> str:
    shutil.copy(migrated_db, tmp_path / "llmq.db")
    return f"sqlite:///{tmp_path / 'llmq.db'}"


def test_a_writer_of_another_process_waits_for_the_lock_and_then_writes(url):
    first, second = Database(url), Database(url)  # two engines, as two processes have
    release, held, wrote = threading.Event(), threading.Event(), threading.Event()

    def hold():
        with first.session() as session:
            session.add(Request(id="holder", model="m", body={}))
            session.flush()
            held.set()
            release.wait(10)

    def write():
        with second.session() as session:
            session.add(Request(id="waiter", model="m", body={}))
        wrote.set()
    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    writer = threading.Thread(target=write)
    writer.start()
    assert not wrote.wait(0.3)  # still waiting for the lock
    with second.read() as session:  # a reader does not wait
        assert session.get(Request, "holder") is None
    release.set()
    for thread in (holder, writer):
        thread.join(10)
    assert wrote.is_set()
    with second.read() as session:
        assert {r.id for r in session.query(Request)} == {"holder", "waiter"}


def test_the_threads_of_one_process_take_turns(url):
    db = Database(url)
    errors = []

    def write(i):
        try:
            with db.session() as session:
                session.add(Request(id=f"r{i}", model="m", body={}))
                session.flush()
                time.sleep(0.002)  # holds the lock a moment, as a busy thread does
        except Exception as err:
            errors.append(err)
    threads = [threading.Thread(target=write, args=(i,)) for i in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    with db.read() as session:
        assert session.query(Request).count() == 40


@pytest.mark.parametrize("status, expected", [(RequestStatus.QUEUED, RequestStatus.RUNNING),
                                              (RequestStatus.COMPLETED, RequestStatus.COMPLETED),
                                              (RequestStatus.CANCELLED, RequestStatus.CANCELLED)])
def test_marking_a_request_running_never_overwrites_a_later_status(url, status, expected):
    db = Database(url)
    with db.session() as session:
        session.add(Request(id="r", model="m", body={}, status=status))
    _mark_running(SimpleNamespace(db=db), "r", at=123.0)
    with db.read() as session:
        row = session.get(Request, "r")
        assert row.status == expected
        assert row.started_at == (123.0 if expected == RequestStatus.RUNNING else None)
