"""The SQLAlchemy engine and sessions, bound to the Flask app (and so to the Celery workers)."""
from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

READ_ONLY = "llmq_read_only"  # an execution option: this connection's transactions only read


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        # Several processes write (web, every worker thread): WAL lets readers run beside the one
        # writer, and a busy timeout makes a writer wait for the lock instead of failing.
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection, _record):
            dbapi_connection.isolation_level = None  # transactions are begun below, not by the driver
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        @event.listens_for(engine, "begin")
        def _begin_immediate(connection):
            # Take the write lock up front: a transaction that reads and then writes would otherwise
            # fail at once ("database is locked") when another process wrote in between, since SQLite
            # cannot wait out that conflict; up front, the busy timeout makes it wait its turn.
            # A read-only transaction takes no lock at all: in WAL mode readers never wait for writers.
            read_only = connection.get_execution_options().get(READ_ONLY, False)
            connection.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=40)


class Database:
    """One engine per process (the web's WebServices.db, the worker's WorkerRuntime.db), a short
    session per unit of work."""

    def __init__(self, url: str):
        self.url = url
        self.engine = make_engine(url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._read_sessions = sessionmaker(self.engine.execution_options(**{READ_ONLY: True}), expire_on_commit=False)
        # SQLite has one write lock for the whole file, and a writer that finds it taken sleeps in
        # steps of up to 100 ms before it looks again. The threads of one process (a worker's task
        # threads, the web's request threads) take their turns here instead, in order and without
        # those sleeps, so SQLite sees at most one writer per process.
        self._write_turn = threading.RLock() if url.startswith("sqlite") else nullcontext()

    @contextmanager
    def session(self) -> Session:
        """A transaction: committed on success, rolled back on error."""
        with self._write_turn, self._sessions() as session, session.begin():
            yield session

    @contextmanager
    def read(self) -> Session:
        """A transaction that only reads. On SQLite it waits for no writer (the hot paths use it: every
        request's key check, polls, a waiting task's "is it done yet"); writing in it is an error there."""
        with self._read_sessions() as session, session.begin():
            yield session
