"""The benchmark's statistics (benchmarks/bracketed.py), exactly."""
import pytest

from benchmarks.bracketed import bracketed_ratios, median_interval


def test_each_run_is_compared_with_the_mean_of_the_reference_runs_around_it():
    # reference 10 s, then 12 s (the machine slowed), then 14 s; runs of 11 s and 13 s between them
    assert bracketed_ratios([10.0, 12.0, 14.0], [11.0, 13.0]) == [pytest.approx(1.0), pytest.approx(1.0)]
    assert bracketed_ratios([8.0, 8.0], [10.0]) == [pytest.approx(0.8)]


def test_a_steady_drift_cancels():
    reference = [10.0 + k for k in range(7)]  # one second slower every run
    runs = [(10.0 + k + 0.5) / 0.85 for k in range(6)]  # 85 % of the reference's speed at its moment
    assert bracketed_ratios(reference, runs) == [pytest.approx(0.85)] * 6


def test_runs_need_a_reference_on_both_sides():
    with pytest.raises(ValueError, match="3 runs need 4 reference runs"):
        bracketed_ratios([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])


@pytest.mark.parametrize("values, expected", [
    # n = 5: P(Bin(5, 1/2) = 0) = 1/32 <= 5 %, P(< 2) = 6/32 > 5 %: the extremes (93.75 %)
    ([0.9, 0.7, 0.8, 1.0, 0.6], (0.6, 0.8, 1.0)),
    # n = 8: P(< 2) = 9/256 <= 5 %, P(< 3) = 37/256 > 5 %: the 2nd and the 7th (93 %)
    ([0.1, 0.8, 0.3, 0.5, 0.2, 0.7, 0.4, 0.6], (0.2, 0.45, 0.7)),
    # n = 12: P(< 3) = 79/4096 <= 5 %, P(< 4) = 299/4096 > 5 %: the 3rd and the 10th
    ([float(v) for v in range(12, 0, -1)], (3.0, 6.5, 10.0)),
])
def test_median_interval_from_order_statistics(values, expected):
    assert median_interval(values) == pytest.approx(expected)


def test_too_few_values_give_no_interval():
    assert median_interval([1.0, 2.0, 3.0, 4.0]) is None  # P(Bin(4, 1/2) = 0) = 1/16 > 5 %
    assert median_interval([1.0, 2.0, 3.0, 4.0], confidence=0.8) == (1.0, 2.5, 4.0)
    assert median_interval([]) is None
