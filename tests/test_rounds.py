"""labkit.rounds: a ratio quoted with its rounds — median, IQR, 'faster' only when the IQR excludes 1.0, drift."""
import statistics

import pytest

from labkit.rounds import bootstrap_median_interval, describe, drift, quartiles, ratio_summary, verdict


def test_quartiles_are_the_inclusive_ones():
    assert quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 3.0, 4.0)
    assert quartiles([0.5]) == (0.5, 0.5, 0.5)


def test_faster_only_when_the_iqr_excludes_one():
    assert verdict(0.90, 0.97) == "faster" and verdict(1.02, 1.10) == "slower"
    assert verdict(0.95, 1.01) == "no clear difference"
    assert verdict(1.02, 1.10, lower_is_faster=False) == "faster"  # a throughput ratio: higher is faster


def test_a_rising_series_is_drift_a_scattered_one_is_not():
    assert drift([0.42, 0.65, 0.69, 0.99, 1.0, 1.1]) == pytest.approx(1.0)
    assert drift([3, 2, 1]) == pytest.approx(-1.0)
    assert abs(drift([1.0, 0.9, 1.1, 0.95, 1.05, 1.0])) < 0.5
    summary = ratio_summary([0.42, 0.65, 0.69, 0.99, 1.0, 1.1])
    assert summary["drifting"] and "DRIFT" in describe(summary)


def test_a_summary_keeps_every_round_and_says_when_there_are_too_few():
    summary = ratio_summary([0.9, 0.95, 0.92, 0.94, 0.91, 0.93, 0.96, 0.9])
    assert summary["rounds"] == [0.9, 0.95, 0.92, 0.94, 0.91, 0.93, 0.96, 0.9] and summary["n_rounds"] == 8
    assert summary["verdict"] == "faster" and not summary["drifting"] and summary["enough_rounds"]
    assert describe(summary).startswith("ratio 0.925 (IQR 0.907–0.942, 8 rounds): faster")
    few = ratio_summary([0.8, 0.9])
    assert not few["enough_rounds"] and "fewer than 6 rounds" in describe(few)


def test_the_bootstrap_interval_of_a_median_holds_the_median_and_is_the_same_for_the_same_seed():
    rounds = [0.95, 0.97, 0.98, 0.99, 1.0, 1.01, 1.02, 0.96, 0.99, 1.0]
    low, high = bootstrap_median_interval(rounds, resamples=2000)
    assert min(rounds) <= low <= statistics.median(rounds) <= high <= max(rounds)
    assert (low, high) == bootstrap_median_interval(rounds, resamples=2000)  # seeded
    narrow = bootstrap_median_interval(rounds, resamples=2000, level=0.5)
    assert low <= narrow[0] <= narrow[1] <= high  # a lower level: a narrower interval
    assert bootstrap_median_interval([1.0, 1.0, 1.0]) == (1.0, 1.0)  # identical rounds: no spread


def test_a_bootstrap_interval_of_nothing_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        bootstrap_median_interval([])
    with pytest.raises(ValueError, match="level"):
        bootstrap_median_interval([1.0], level=1.5)
