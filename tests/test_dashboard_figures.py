"""The dashboard's figures, exactly: a batch's progress (percent, tokens/s, time left), the chart's
points, how times and durations are written."""
from __future__ import annotations

import pytest

from app.dashboard.chart import HEIGHT, WIDTH, chart
from app.dashboard.formatting import duration, rate
from llmq.fleet_history import BUCKET_S, HISTORY_S, FleetSample
from llmq.store.batch_progress import batch_progress
from llmq.store.models import Batch, BatchStatus


def batch(**fields) -> Batch:
    base = {"status": BatchStatus.IN_PROGRESS, "total": 100, "completed": 0, "failed": 0, "completion_tokens": 0,
            "in_progress_at": 1000.0}
    return Batch(**{**base, **fields})


def test_progress_before_anything_finished_has_no_pace_to_go_by():
    progress = batch_progress(batch(), now=1010.0)
    assert (progress.percent, progress.elapsed_s, progress.tokens_per_s, progress.seconds_left) == (0.0, 10.0, 0.0, None)


def test_time_left_is_the_lines_left_at_the_pace_so_far():
    progress = batch_progress(batch(completed=20, failed=5, completion_tokens=2000), now=1050.0)
    assert progress.done == 25 and progress.percent == 25.0
    assert progress.tokens_per_s == 40.0  # 2000 tokens in 50 s
    assert progress.seconds_left == 150.0  # 75 lines left at 2 s a line


def test_an_ended_batch_is_measured_to_its_end_and_has_no_time_left():
    ended = batch(status=BatchStatus.COMPLETED, completed=100, completion_tokens=5000, finalizing_at=1100.0,
                  completed_at=1101.0)
    progress = batch_progress(ended, now=5000.0)
    assert (progress.percent, progress.elapsed_s, progress.tokens_per_s, progress.seconds_left) == (100.0, 100.0, 50.0, None)


def test_a_batch_not_started_has_no_elapsed_time():
    progress = batch_progress(batch(status=BatchStatus.VALIDATING, in_progress_at=None, total=0), now=2000.0)
    assert (progress.percent, progress.elapsed_s, progress.tokens_per_s) == (0.0, None, None)


def sample(at: float, queued: int, workers: int = 1, desired: int | None = None) -> FleetSample:
    return FleetSample(at=at, queued=queued, workers=workers, running=0, desired=desired)


def test_the_chart_spans_the_hour_and_scales_to_the_largest_value():
    now = 10_000.0
    start = now - HISTORY_S
    drawn = chart([sample(start, 0), sample(start + BUCKET_S, 4, workers=2, desired=3)], now)
    step = BUCKET_S / HISTORY_S * WIDTH
    assert drawn.top == 4 and drawn.samples == 2
    assert drawn.queued == [f"0.0,{HEIGHT:.1f} {step:.1f},0.0"]
    assert drawn.workers == [f"0.0,{HEIGHT - HEIGHT / 4:.1f} {step:.1f},{HEIGHT / 2:.1f}"]
    assert drawn.desired == [f"{step - 2:.1f},{HEIGHT / 4:.1f} {step + 2:.1f},{HEIGHT / 4:.1f}"]  # one sample: a dash


def test_a_missing_bucket_breaks_the_line():
    now = 10_000.0
    samples = [sample(now - 4 * BUCKET_S, 1), sample(now - 3 * BUCKET_S, 1), sample(now - BUCKET_S, 1),
               sample(now, 1)]
    assert len(chart(samples, now).queued) == 2


@pytest.mark.parametrize("seconds, said", [(None, "—"), (0.4, "0 s"), (42, "42 s"), (60, "1 min"), (185, "3 min 5 s"),
                                           (3600, "1 h"), (7800, "2 h 10 min")])
def test_durations_as_a_person_says_them(seconds, said):
    assert duration(seconds) == said


def test_rates():
    assert (rate(None), rate(12.345), rate(1234.5)) == ("—", "12.3", "1,234")
