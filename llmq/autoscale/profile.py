"""A traffic profile: how many workers to keep warm in each hour of the week, so that a fleet
scaled to zero (or to its minimum) is already up when the day's traffic usually comes, instead of
every morning's first requests waiting for a cold start.

LLMQ_AUTOSCALE_PROFILE is either a list of windows, comma-separated:

    mon-fri 08-18=3, sat 10:30-14=1, fri 22-02=2, 07-09=1

each one DAYS HOURS=WORKERS: DAYS is a day (mon ... sun, or the full name), a range of days (mon-fri;
a range may wrap, fri-mon), or `daily` (also what an entry without days means); HOURS is
START-END in HH or HH:MM of the autoscaler's local time (set TZ to change it), END exclusive, 24
for midnight, and an END before START runs past midnight into the next day. Where windows overlap
the larger count holds. Or it is `predict` (`predict:N` for N weeks of history, default 4): the
windows are predicted from the arrivals the database recorded (llmq/autoscale/predict.py).

Outside every window the profile asks for nothing, and the policy keeps LLMQ_AUTOSCALE_MIN.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
DAY_NAMES = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
SECONDS_PER_DAY = 24 * 3600
SECONDS_PER_WEEK = 7 * SECONDS_PER_DAY
DEFAULT_PREDICT_WEEKS = 4
MAX_PREDICT_WEEKS = 52

_ENTRY = re.compile(r"^(?:(?P<days>[a-z*]+(?:-[a-z]+)?)\s+)?(?P<start>\d{1,2}(?::\d{1,2})?)\s*-\s*"
                    r"(?P<end>\d{1,2}(?::\d{1,2})?)\s*=\s*(?P<workers>\S+)$")
_EXAMPLE = "an entry is DAYS HH-HH=WORKERS, e.g. 'mon-fri 08-18=3' (or the whole value is 'predict')"


@dataclass(frozen=True)
class Window:
    """Workers kept warm from `start` to `end`, in seconds of the week from Monday 00:00; `end` may
    pass the end of the week (a window from Sunday evening into Monday)."""

    start: int
    end: int
    workers: int


@dataclass(frozen=True)
class Profile:
    windows: tuple[Window, ...]
    source: str = ""  # what it was made from, for the log

    def peak(self, start: datetime, seconds: float = 0.0) -> int:
        """The most workers any window asks for at some moment from `start` to `start + seconds`
        (both included): the workers to keep warm now, if they take `seconds` to start."""
        if seconds >= SECONDS_PER_WEEK:
            return max((w.workers for w in self.windows), default=0)
        first = second_of_week(start)
        last = first + seconds
        return max((w.workers for w in self.windows if _meets(w, first, last)), default=0)

    def workers_at(self, when: datetime) -> int:
        return self.peak(when, 0.0)

    def describe(self) -> str:
        return self.source or ", ".join(describe_window(w) for w in self.windows) or "(no windows)"


@dataclass(frozen=True)
class Predict:
    """The profile is predicted from the recorded arrivals of the past `weeks` weeks."""

    weeks: int = DEFAULT_PREDICT_WEEKS


def second_of_week(when: datetime) -> float:
    return (when.weekday() * SECONDS_PER_DAY + when.hour * 3600 + when.minute * 60 + when.second
            + when.microsecond / 1e6)


def _meets(window: Window, first: float, last: float) -> bool:
    # A window and the interval may each cross the end of the week: compare them a week apart too.
    return any(window.start + shift <= last and first < window.end + shift
               for shift in (-SECONDS_PER_WEEK, 0, SECONDS_PER_WEEK))


def describe_window(window: Window) -> str:
    day, start = divmod(window.start, SECONDS_PER_DAY)
    end = window.end - day * SECONDS_PER_DAY
    end = end - SECONDS_PER_DAY if end > SECONDS_PER_DAY else end
    return f"{DAYS[day]} {_clock(start)}-{_clock(end)}={window.workers}"


def _clock(seconds: int) -> str:
    hours, minutes = divmod(seconds // 60, 60)
    return f"{hours:02d}" if not minutes else f"{hours:02d}:{minutes:02d}"


def parse_profile(text: str) -> Profile | Predict:
    """LLMQ_AUTOSCALE_PROFILE's value as a Profile (or Predict); a ValueError names the entry that is
    wrong and what is wrong with it."""
    value = text.strip().lower()
    if value == "predict" or value.startswith("predict:"):
        return _parse_predict(value)
    windows = []
    for number, entry in enumerate(value.split(","), start=1):
        entry = entry.strip()
        if not entry:
            raise ValueError(f"LLMQ_AUTOSCALE_PROFILE entry {number} is empty (two commas in a row, or a comma "
                             f"at the end?); {_EXAMPLE}")
        try:
            windows.extend(_parse_entry(entry))
        except ValueError as err:
            raise ValueError(f"LLMQ_AUTOSCALE_PROFILE entry {number} ({entry!r}): {err}; {_EXAMPLE}") from None
    return Profile(tuple(windows), source=text.strip())


def _parse_predict(value: str) -> Predict:
    weeks = value.partition(":")[2].strip() or str(DEFAULT_PREDICT_WEEKS)
    if not weeks.isdigit() or not 1 <= int(weeks) <= MAX_PREDICT_WEEKS:
        raise ValueError(f"LLMQ_AUTOSCALE_PROFILE is {value!r}: 'predict:N' takes N, the weeks of recorded arrivals "
                         f"to predict from, a whole number from 1 to {MAX_PREDICT_WEEKS}")
    return Predict(int(weeks))


def _parse_entry(entry: str) -> list[Window]:
    match = _ENTRY.match(entry)
    if match is None:
        raise ValueError("it is not DAYS START-END=WORKERS")
    workers = match["workers"]
    if not workers.isdigit():
        raise ValueError(f"the workers after '=' must be a whole number, got {workers!r}")
    start, end = _time(match["start"], is_end=False), _time(match["end"], is_end=True)
    if start == end:
        raise ValueError(f"the window starts and ends at {match['start']} (for the whole day, write 00-24)")
    length = end - start if end > start else end + SECONDS_PER_DAY - start
    return [Window(day * SECONDS_PER_DAY + start, day * SECONDS_PER_DAY + start + length, int(workers))
            for day in _days(match["days"] or "daily")]


def _days(text: str) -> list[int]:
    if text in ("daily", "*"):
        return list(range(7))
    first, _, last = text.partition("-")
    first_day = _day(first)
    if not last:
        return [first_day]
    last_day = _day(last)
    return [(first_day + i) % 7 for i in range((last_day - first_day) % 7 + 1)]


def _day(text: str) -> int:
    if text in DAYS:
        return DAYS.index(text)
    if text in DAY_NAMES:
        return DAY_NAMES.index(text)
    raise ValueError(f"{text!r} is not a day (mon, tue, wed, thu, fri, sat, sun, a range like mon-fri, or daily)")


def _time(text: str, is_end: bool) -> int:
    hours, _, minutes = text.partition(":")
    hour, minute = int(hours), int(minutes or 0)
    if minute > 59:
        raise ValueError(f"{text!r}: the minutes must be 00 to 59")
    if hour > 24 or (hour == 24 and minute):
        raise ValueError(f"{text!r}: the hour must be 00 to 24 (24 is midnight at the end of the day)")
    if hour == 24 and not is_end:
        raise ValueError(f"{text!r}: a window cannot start at 24 (write 00)")
    return hour * 3600 + minute * 60
