"""The arrivals the database recorded (llmq/store/arrivals.py), read as the autoscaler reads them: a
count in a span of time, the times for a replay, the stays for the predicted profile."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmq.autoscale.predict import Span, spans_of
from llmq.store.arrivals import arrival_times, arrivals_between, batch_stays, request_stays
from llmq.store.database import Database
from llmq.store.models import Batch, File, Request

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def db(tmp_path, migrated_db) -> Database:
    shutil.copy(migrated_db, tmp_path / "llmq.db")
    db = Database(f"sqlite:///{tmp_path / 'llmq.db'}")
    with db.session() as session:
        file = File(filename="in.jsonl", purpose="batch", bytes=1, content=b"x")
        session.add(file)
        session.flush()
        for created, finished, model in ((100.0, 130.0, "m"), (105.0, None, "m"), (110.0, 111.0, "other"),
                                         (200.0, 201.0, "m")):
            session.add(Request(model=model, body={}, created_at=created, finished_at=finished))
        session.add(Batch(endpoint="/v1/completions", model="m", input_file_id=file.id, created_at=140.0,
                          in_progress_at=150.0, finalizing_at=190.0, total=30))
        session.add(Batch(endpoint="/v1/completions", model="m", input_file_id=file.id, created_at=160.0,
                          in_progress_at=170.0, total=5))  # still running
        session.add(Batch(endpoint="/v1/completions", model="m", input_file_id=file.id, created_at=180.0))  # validating
    return db


def test_arrivals_in_a_span_of_time_count_batch_lines_when_the_batch_starts(db):
    with db.read() as session:
        assert arrivals_between(session, "m", 0, 1000) == 3 + 30 + 5
        assert arrivals_between(session, "m", 100, 150) == 1 + 30  # after `since`, up to `until`
        assert arrivals_between(session, "m", 150, 169) == 0
        assert arrivals_between(session, "other", 0, 1000) == 1
        assert arrivals_between(session, "none", 0, 1000) == 0


def test_arrival_times_for_a_replay(db):
    with db.read() as session:
        times = arrival_times(session, "m", 100, 200)
    assert times == [100.0, 105.0] + [150.0] * 30 + [170.0] * 5


def test_stays_become_spans_of_demand(db):
    with db.read() as session:
        requests, batches = request_stays(session, "m", 0, 1000), batch_stays(session, "m", 0, 1000)
    assert sorted(requests, key=lambda r: r[0]) == [(100.0, 130.0), (105.0, None), (200.0, 201.0)]
    assert sorted(batches) == [(150.0, 190.0, 30), (170.0, None, 5)]
    spans = spans_of(sorted(requests, key=lambda r: r[0]), sorted(batches), now=300.0)
    assert spans == [Span(100.0, 130.0), Span(105.0, 300.0), Span(200.0, 201.0),
                     Span(150.0, 190.0, 30, drains=True), Span(170.0, 300.0, 5, drains=True)]


def test_llmq_autoscale_replays_the_recorded_arrivals(tmp_path, migrated_db):
    shutil.copy(migrated_db, tmp_path / "llmq.db")
    url = f"sqlite:///{tmp_path / 'llmq.db'}"
    now = time.time()
    with Database(url).session() as session:
        for ago in (3000, 2000, 1000, 7200):  # the last one is before the hour replayed
            session.add(Request(model="served", body={}, created_at=now - ago, finished_at=now - ago + 5))
    done = subprocess.run([sys.executable, "-m", "stack.cli", "autoscale", "--replay", "database", "--hours", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LLMQ_HOME": str(tmp_path), "DATABASE_URL": url, "MODEL_NAME": "served",
                               "LLMQ_AUTOSCALE_MIN": "0"})
    assert done.returncode == 0, done.stderr
    assert "replay of served, the past 1 h" in done.stdout and ": 3 arrivals over" in done.stdout
