"""The traffic profile predicted from the past (LLMQ_AUTOSCALE_PROFILE=predict): for each hour of the
week, the workers that the requests recorded in that hour of the past weeks kept busy.

Each past hour's demand is the mean number of requests in the system during it (queued or running,
as the policy counts them): an API request counts from its arrival to its end, a batch's lines
count from the batch's start and drain evenly to none at its end (the database keeps one time per
batch, not per line). An hour of the week asks for ceil(median demand over the past weeks /
target_ongoing) workers: the median, so one unusual week neither adds a window nor removes one.
Only whole hours since the first recorded arrival count, so a young install predicts from the weeks
it has.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from datetime import datetime, timedelta, tzinfo

from llmq.autoscale.profile import SECONDS_PER_WEEK, Profile, Window, describe_window, second_of_week

HOUR = 3600


@dataclass(frozen=True)
class Span:
    """`count` requests in the system from `start` to `end` (unix times); with `drains`, they leave
    evenly over it (a batch's lines), else all stay to the end (one request, count 1)."""

    start: float
    end: float
    count: int = 1
    drains: bool = False

    def requests_seconds(self, a: float, b: float) -> float:
        """The integral of this span's requests in the system over [a, b]."""
        a, b = max(a, self.start), min(b, self.end)
        if b <= a:
            return 0.0
        if not self.drains:
            return self.count * (b - a)
        length = self.end - self.start
        return self.count * ((self.end - a) ** 2 - (self.end - b) ** 2) / (2 * length)


def spans_of(requests: list[tuple[float, float | None]], batches: list[tuple[float, float | None, int]],
             now: float) -> list[Span]:
    """Spans from the stays llmq.store.arrivals reads: an API request's (arrived, finished), a batch's
    (started, ended, lines); what has not ended stays until `now`."""
    spans = [Span(arrived, finished if finished is not None else now) for arrived, finished in requests]
    spans += [Span(started, ended if ended is not None else now, lines, drains=True)
              for started, ended, lines in batches if lines]
    return spans


def hourly_demand(spans: list[Span], since: float, until: float, tz: tzinfo | None = None) -> list[tuple[int, float]]:
    """(hour of the week, mean requests in the system) for every whole local hour from `since`
    (rounded up to the hour) to `until`, oldest first."""
    first = datetime.fromtimestamp(since, tz)
    hour_start = first.replace(minute=0, second=0, microsecond=0)
    if hour_start < first:
        hour_start += timedelta(hours=1)
    start_ts = hour_start.timestamp()
    hours = max(0, int((until - start_ts) // HOUR))
    totals = [0.0] * hours
    for span in spans:
        lo = max(0, int((span.start - start_ts) // HOUR))
        hi = min(hours, int(math.ceil((span.end - start_ts) / HOUR)))
        for i in range(lo, hi):
            totals[i] += span.requests_seconds(start_ts + i * HOUR, start_ts + (i + 1) * HOUR)
    slot0 = int(second_of_week(hour_start) // HOUR)
    return [((slot0 + i) % (SECONDS_PER_WEEK // HOUR), total / HOUR) for i, total in enumerate(totals)]


def predict_profile(spans: list[Span], now: float, weeks: int, target_ongoing: int,
                    tz: tzinfo | None = None) -> Profile:
    """The profile the recorded spans of the past `weeks` weeks ask for (see the module's docstring)."""
    since = now - weeks * SECONDS_PER_WEEK
    if spans:
        since = max(since, min(span.start for span in spans))
    by_slot: dict[int, list[float]] = {}
    for slot, demand in hourly_demand(spans, since, now, tz):
        by_slot.setdefault(slot, []).append(demand)
    workers = {slot: math.ceil(statistics.median(values) / target_ongoing) for slot, values in by_slot.items()}
    windows = _merged(workers)
    described = ", ".join(describe_window(w) for w in windows) or "no hour with recorded traffic"
    return Profile(windows, source=f"predicted from the past {weeks} week(s): {described}")


def _merged(workers: dict[int, int]) -> tuple[Window, ...]:
    """Hourly slots as windows, neighbours of the same day and count joined."""
    windows: list[Window] = []
    for slot in sorted(workers):
        count = workers[slot]
        if count <= 0:
            continue
        start = slot * HOUR
        last = windows[-1] if windows else None
        if last is not None and last.end == start and last.workers == count and start % (24 * HOUR):
            windows[-1] = Window(last.start, start + HOUR, count)
        else:
            windows.append(Window(start, start + HOUR, count))
    return tuple(windows)
