"""Arrival traces for the replay: a synthetic morning, a CSV file, or the arrivals the database
recorded (llmq.store.arrivals.arrival_times). A trace is the arrival times in seconds from its
start, and, when they were clock times, the unix time of its start (so a profile applies to them).

A trace file has one arrival per line, `time[,count]`: the time in seconds (from any origin; unix
times are read as clock times) and optionally how many arrived then (a batch's lines). A first line
that is not a number is a header. Lines starting with # are comments.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

CLOCK_TIME_AFTER = 1e9  # a time this large is a unix time (September 2001 on)


@dataclass(frozen=True)
class Trace:
    times: tuple[float, ...]  # seconds from the start, in order
    start: float | None = None  # the unix time of second 0, if the trace is of clock times
    name: str = ""


def trace_of_times(times: list[float], name: str = "") -> Trace:
    """A trace of arrival times: relative to the first, and of the clock if they are unix times."""
    times = sorted(times)
    if not times:
        return Trace((), None, name)
    origin = times[0]
    return Trace(tuple(t - origin for t in times), origin if origin > CLOCK_TIME_AFTER else None, name)


def read_trace(path: str | Path) -> Trace:
    """A trace file (see the module's docstring); a ValueError names the line that is wrong."""
    times: list[float] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        fields = [f.strip() for f in line.split(",")]
        if not fields[0] or fields[0].startswith("#"):
            continue
        try:
            time = float(fields[0])
            count = int(fields[1]) if len(fields) > 1 and fields[1] else 1
        except ValueError:
            if number == 1 and not times:  # a header
                continue
            raise ValueError(f"{path}:{number}: expected time[,count] (seconds, and a whole number of arrivals), "
                             f"got {line.strip()!r}") from None
        if not math.isfinite(time) or count < 0:
            raise ValueError(f"{path}:{number}: the time must be a finite number and the count 0 or more, "
                             f"got {line.strip()!r}")
        times.extend([time] * count)
    if not times:
        raise ValueError(f"{path}: no arrivals in the file (one line per arrival: time[,count])")
    return trace_of_times(times, name=Path(path).name)


# A morning, as requests per second at the start of each stretch (linear in between), and the batch
# dropped into it: quiet, a ramp as people arrive, a steady hour with a bulk job in it, a fall.
SYNTHETIC_RATE = ((0, 0.05), (40 * 60, 0.05), (80 * 60, 1.5), (120 * 60, 1.5), (140 * 60, 0.1), (160 * 60, 0.02),
                  (170 * 60, 0.0))
SYNTHETIC_BATCH = (90 * 60, 300)  # 300 lines at 08:30
SYNTHETIC_START = datetime(2024, 1, 1, 7, 0)  # a Monday, 07:00 local time


def synthetic_rate(t: float) -> float:
    for (t0, r0), (t1, r1) in zip(SYNTHETIC_RATE, SYNTHETIC_RATE[1:]):
        if t0 <= t < t1:
            return r0 + (r1 - r0) * (t - t0) / (t1 - t0)
    return 0.0


def synthetic_trace(seed: int = 0) -> Trace:
    """Poisson arrivals at synthetic_rate (by thinning: candidates at the peak rate, each kept with
    the rate's share of the peak), plus SYNTHETIC_BATCH's lines at once. The same seed, the same trace."""
    rng = random.Random(seed)
    peak = max(r for _, r in SYNTHETIC_RATE)
    end = SYNTHETIC_RATE[-1][0]
    times, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= end:
            break
        if rng.random() < synthetic_rate(t) / peak:
            times.append(t)
    times.extend([float(SYNTHETIC_BATCH[0])] * SYNTHETIC_BATCH[1])
    return Trace(tuple(sorted(times)), SYNTHETIC_START.timestamp(), name="synthetic")
