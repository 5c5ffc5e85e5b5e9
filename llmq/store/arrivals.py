"""The arrivals the database recorded, per model, for the autoscaler: how many came in a span of time
(its smoothed arrival rate), when each came (a replay of the past), and how long each stayed (the
predicted traffic profile). An API request arrives at its `created_at`; a batch's lines arrive
together when the batch starts (`in_progress_at`), since that is when they are queued.

Read-only: every query here runs in `Database.read()`.
"""
from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from llmq.store.models import Batch, Request


def arrivals_between(session: Session, model: str, since: float, until: float) -> int:
    """Requests and batch lines of `model` that arrived after `since`, up to `until`."""
    requests = session.scalar(select(func.count()).select_from(Request).where(
        Request.model == model, Request.created_at > since, Request.created_at <= until))
    lines = session.scalar(select(func.coalesce(func.sum(Batch.total), 0)).where(
        Batch.model == model, Batch.in_progress_at > since, Batch.in_progress_at <= until))
    return int(requests or 0) + int(lines or 0)


def arrival_times(session: Session, model: str, since: float, until: float) -> list[float]:
    """When each request and batch line of `model` arrived in [since, until), in order; a batch's
    lines all at its start."""
    times = list(session.scalars(select(Request.created_at).where(
        Request.model == model, Request.created_at >= since, Request.created_at < until)))
    for started, lines in session.execute(select(Batch.in_progress_at, Batch.total).where(
            Batch.model == model, Batch.in_progress_at >= since, Batch.in_progress_at < until)):
        times.extend([started] * lines)
    return sorted(times)


def request_stays(session: Session, model: str, since: float, until: float) -> list[tuple[float, float | None]]:
    """(arrived, finished or None) of every API request of `model` that arrived in [since, until)."""
    return [tuple(row) for row in session.execute(select(Request.created_at, Request.finished_at).where(
        Request.model == model, Request.created_at >= since, Request.created_at < until))]


def batch_stays(session: Session, model: str, since: float,
                until: float) -> list[tuple[float, float | None, int]]:
    """(started, ended or None, lines) of every batch of `model` that started in [since, until); it
    ends when its last line is done (finalizing), or when it failed, expired or was cancelled."""
    ended = func.coalesce(Batch.finalizing_at, Batch.failed_at, Batch.expired_at, Batch.cancelling_at)
    return [tuple(row) for row in session.execute(select(Batch.in_progress_at, ended, Batch.total).where(
        Batch.model == model, Batch.in_progress_at >= since, Batch.in_progress_at < until))]
