"""The traffic profile (llmq/autoscale/profile.py) and its prediction from recorded arrivals
(llmq/autoscale/predict.py), exactly: windows, pre-warming ahead of a window, errors that say what
to fix, and the median demand per hour of the week."""
from __future__ import annotations

from datetime import datetime, timezone

import pytest

from llmq.autoscale.predict import Span, hourly_demand, predict_profile
from llmq.autoscale.profile import Predict, Profile, Window, parse_profile

MONDAY = datetime(2024, 1, 1)  # a Monday, 00:00
DAY, HOUR, WEEK = 86400, 3600, 7 * 86400


def at(day: int, hour: int, minute: int = 0) -> datetime:
    return MONDAY.replace(day=1 + day, hour=hour, minute=minute)


def test_weekday_hours():
    profile = parse_profile("mon-fri 08-18=3, sat 10-14=1")
    assert profile.windows[0] == Window(8 * HOUR, 18 * HOUR, 3)
    assert len(profile.windows) == 6
    assert profile.workers_at(at(0, 7, 59)) == 0
    assert profile.workers_at(at(0, 8)) == 3
    assert profile.workers_at(at(4, 17, 59)) == 3
    assert profile.workers_at(at(4, 18)) == 0  # the end is exclusive
    assert profile.workers_at(at(5, 12)) == 1
    assert profile.workers_at(at(6, 12)) == 0


def test_pre_warming_reads_the_profile_one_start_up_ahead():
    profile = parse_profile("mon-fri 08-18=3")
    assert profile.peak(at(0, 7, 58), 60) == 0
    assert profile.peak(at(0, 7, 59), 60) == 3  # started a minute before 08:00, ready at 08:00
    assert profile.peak(at(0, 17, 59), 600) == 3  # a window's last minutes stay warm


def test_a_window_shorter_than_the_start_up_is_still_warmed():
    assert parse_profile("tue 09:00-09:10=2").peak(at(1, 8, 30), 3600) == 2


def test_windows_past_midnight_and_past_the_end_of_the_week():
    profile = parse_profile("fri 22-02=2, sun 23-01=1")
    assert profile.workers_at(at(4, 23)) == 2
    assert profile.workers_at(at(5, 1, 59)) == 2
    assert profile.workers_at(at(5, 2)) == 0
    assert profile.workers_at(at(6, 23, 30)) == 1
    assert profile.workers_at(at(0, 0, 30)) == 1  # Monday 00:30, from Sunday's window
    assert profile.peak(at(6, 22), 2 * HOUR) == 1  # a look-ahead across the end of the week


def test_overlapping_windows_take_the_larger_count():
    profile = parse_profile("daily 08-20=1, wed 12-14=4")
    assert profile.workers_at(at(2, 13)) == 4
    assert profile.workers_at(at(2, 15)) == 1
    assert profile.workers_at(at(3, 13)) == 1


def test_day_names_ranges_and_minutes():
    profile = parse_profile("Friday-Mon 10:30-11:45=2, 07-08=1")
    assert [w.start // DAY for w in profile.windows[:4]] == [4, 5, 6, 0]
    assert profile.workers_at(at(0, 10, 29)) == 0
    assert profile.workers_at(at(0, 10, 30)) == 2
    assert profile.workers_at(at(0, 11, 45)) == 0
    assert profile.workers_at(at(2, 7, 30)) == 1  # no days: every day
    assert parse_profile("mon 00-24=1").workers_at(at(0, 23, 59)) == 1


def test_predict_and_its_weeks():
    assert parse_profile("predict") == Predict(4)
    assert parse_profile(" Predict:8 ") == Predict(8)


def test_describe_says_the_windows():
    profile = Profile((Window(4 * DAY + 22 * HOUR, 5 * DAY + 2 * HOUR, 2), Window(8 * HOUR + 1800, 24 * HOUR, 1)))
    assert profile.describe() == "fri 22-02=2, mon 08:30-24=1"


@pytest.mark.parametrize(("text", "message"), [
    ("mon-fri 08-18", r"entry 1 \('mon-fri 08-18'\): it is not DAYS START-END=WORKERS; an entry is DAYS HH-HH=WORKERS"),
    ("mon-fri 08-18=3,, sat 10-14=1", "entry 2 is empty"),
    ("mon-fri 08-18=3,", "entry 2 is empty"),
    ("mo 08-18=3", "'mo' is not a day"),
    ("mon-fry 08-18=3", "'fry' is not a day"),
    ("mon 25-26=1", "'25': the hour must be 00 to 24"),
    ("mon 24-02=1", "a window cannot start at 24"),
    ("mon 08:75-09=1", "the minutes must be 00 to 59"),
    ("mon 08-08=1", "the window starts and ends at 08"),
    ("mon 08-18=three", "the workers after '=' must be a whole number, got 'three'"),
    ("mon 08-18=-1", "the workers after '=' must be a whole number"),
    ("predict:0", "'predict:N' takes N"),
    ("predict:lots", "'predict:N' takes N"),
])
def test_a_bad_profile_says_which_entry_and_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message) as err:
        parse_profile(text)
    assert str(err.value).startswith("LLMQ_AUTOSCALE_PROFILE")


# ---- prediction -------------------------------------------------------------------------------

UTC = timezone.utc
T0 = datetime(2024, 1, 1, tzinfo=UTC).timestamp()  # Monday 00:00 UTC


def test_a_request_counts_for_the_hours_it_was_in_the_system():
    spans = [Span(T0 + 9 * HOUR + 1800, T0 + 10 * HOUR + 900)]  # 09:30 to 10:15
    assert hourly_demand(spans, T0 + 9 * HOUR, T0 + 11 * HOUR, UTC) == [(9, 0.5), (10, 0.25)]


def test_a_batch_drains_evenly_over_its_run():
    batch = Span(T0, T0 + 2 * HOUR, count=100, drains=True)
    # 100 lines falling to none over two hours: 75 on average in the first, 25 in the second.
    assert hourly_demand([batch], T0, T0 + 3 * HOUR, UTC) == [(0, 75.0), (1, 25.0), (2, 0.0)]


def test_only_whole_hours_count():
    assert [slot for slot, _ in hourly_demand([], T0 + 1800, T0 + 3 * HOUR + 1800, UTC)] == [1, 2]


def test_the_prediction_is_the_median_week_per_hour_of_the_week():
    spans = []
    for week, batch_lines in enumerate([40, 48, 400, 44]):  # one unusual week
        start = T0 + week * WEEK + 9 * HOUR  # Mondays 09:00, one hour of work
        spans.append(Span(start, start + HOUR, count=batch_lines * 2, drains=True))
    now = T0 + 4 * WEEK
    profile = predict_profile(spans, now, weeks=4, target_ongoing=16, tz=UTC)
    # Mean demand in the hour: half the lines; per week 40, 48, 400, 44; median 46; 46 / 16 -> 3.
    assert profile.windows == (Window(9 * HOUR, 10 * HOUR, 3),)
    assert profile.workers_at(datetime(2024, 2, 5, 9, 30, tzinfo=UTC)) == 3
    assert profile.describe() == "predicted from the past 4 week(s): mon 09-10=3"


def test_an_hour_busy_in_only_one_week_of_four_is_not_kept_warm():
    spans = [Span(T0 + 2 * WEEK + 14 * HOUR, T0 + 2 * WEEK + 15 * HOUR, count=10)]
    spans.append(Span(T0, T0 + 60))  # the history begins on the first Monday
    profile = predict_profile(spans, T0 + 4 * WEEK, weeks=4, target_ongoing=4, tz=UTC)
    assert profile.workers_at(datetime(2024, 1, 29, 14, 30, tzinfo=UTC)) == 0


def test_a_young_install_predicts_from_the_weeks_it_has():
    # One week of history, every weekday 10-12 busy with 8 requests in the system.
    spans = [Span(T0 + day * DAY + 10 * HOUR, T0 + day * DAY + 12 * HOUR, count=8) for day in range(5)]
    profile = predict_profile(spans, T0 + WEEK, weeks=4, target_ongoing=4, tz=UTC)
    assert profile.windows == tuple(Window(day * DAY + 10 * HOUR, day * DAY + 12 * HOUR, 2) for day in range(5))


def test_no_history_predicts_nothing():
    profile = predict_profile([], T0, weeks=4, target_ongoing=4, tz=UTC)
    assert profile.windows == () and profile.workers_at(datetime.now()) == 0
