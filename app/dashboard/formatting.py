"""How the pages write times, durations and rates (Jinja filters)."""
from __future__ import annotations

import time

from app.dashboard.blueprint import blueprint


@blueprint.app_template_filter("clock")
def clock(unix: float | None) -> str:
    """A moment as local date and time, to the second; a dash for none (or one a heartbeat lacks)."""
    if not isinstance(unix, (int, float)):
        return "—"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))


@blueprint.app_template_filter("duration")
def duration(seconds: float | None) -> str:
    """A span as a person says it: 42 s, 3 min 5 s, 2 h 10 min; a dash for none."""
    if seconds is None:
        return "—"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s" if seconds else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


@blueprint.app_template_filter("rate")
def rate(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.1f}" if value < 100 else f"{value:,.0f}"
