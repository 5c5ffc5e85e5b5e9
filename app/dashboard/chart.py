"""The workers page's chart of the last hour, drawn as SVG on the server: a polyline per series,
in a viewBox the page scales. Plain arithmetic on the samples (llmq/fleet_history.py)."""
from __future__ import annotations

from dataclasses import dataclass

from llmq.fleet_history import BUCKET_S, HISTORY_S, FleetSample

WIDTH, HEIGHT = 600, 160


@dataclass(frozen=True)
class Chart:
    queued: list[str]  # polyline point lists, one per unbroken run of samples
    workers: list[str]
    desired: list[str]
    top: int  # the value at the top edge
    samples: int


def chart(samples: list[FleetSample], now: float, span_s: float = HISTORY_S) -> Chart:
    """Each series as runs of "x,y" points; a bucket with no sample breaks the line, since nothing
    watched the fleet then."""
    top = max([1, *(s.queued for s in samples), *(s.workers for s in samples),
               *(s.desired or 0 for s in samples)])
    start = now - span_s

    def runs(value) -> list[str]:
        lines, points, previous = [], [], None
        for sample in samples:
            y = value(sample)
            if y is None or (previous is not None and sample.at - previous > BUCKET_S):
                if points:
                    lines.append(" ".join(points))
                points = []
            if y is not None:
                x = (sample.at - start) / span_s * WIDTH
                points.append(f"{x:.1f},{HEIGHT - y / top * HEIGHT:.1f}")
            previous = sample.at
        if points:
            lines.append(" ".join(points))
        return [run if " " in run else _widened(run) for run in lines]

    return Chart(queued=runs(lambda s: s.queued), workers=runs(lambda s: s.workers),
                 desired=runs(lambda s: s.desired), top=top, samples=len(samples))


def _widened(point: str) -> str:
    """A lone sample as a short dash, since a polyline of one point draws nothing."""
    x, y = (float(v) for v in point.split(","))
    return f"{x - 2:.1f},{y:.1f} {x + 2:.1f},{y:.1f}"
