"""Ratios against a reference measured on both sides, and how sure their median is.

This machine's speed drifts by a third within minutes, so a service run compared with one offline run
made before it carries the drift between the two. Runs are interleaved instead — offline, service,
offline, service, ..., offline — and each service run is compared with the mean of the offline runs on
either side of it, which cancels a drift that is steady over the span of the three. What is left is
noise, so the figure quoted is the median of the per-run ratios with a distribution-free confidence
interval (order statistics of the binomial: no assumption about the noise's shape).
"""
from __future__ import annotations

import math
import statistics


def bracketed_ratios(reference_seconds: list[float], run_seconds: list[float]) -> list[float]:
    """Throughput ratio of each run to the reference runs on either side of it: run k lies between
    reference runs k and k + 1, and its ratio is their mean time over its own (above 1: faster)."""
    if len(reference_seconds) != len(run_seconds) + 1:
        raise ValueError(f"{len(run_seconds)} runs need {len(run_seconds) + 1} reference runs around them, "
                         f"got {len(reference_seconds)}")
    return [(reference_seconds[k] + reference_seconds[k + 1]) / 2 / seconds for k, seconds in enumerate(run_seconds)]


def median_interval(values: list[float], confidence: float = 0.9) -> tuple[float, float, float] | None:
    """(low, median, high): the median and an interval that holds the true median with at least
    `confidence`, from the order statistics x(k) and x(n+1-k) with the largest k for which
    P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2. None when n is too small for that confidence
    (5 values for 90 %)."""
    ordered, n = sorted(values), len(values)
    tail = (1 - confidence) / 2
    below = 0.0  # P(Binomial(n, 1/2) < k), for k = 1, 2, ...
    k = 0
    while True:
        below += math.comb(n, k) / 2 ** n
        if below > tail or k + 1 > n - k:
            break
        k += 1
    if k == 0:
        return None
    return ordered[k - 1], statistics.median(ordered), ordered[n - k]
