"""benchmarks/browser_times.py: which notebooks it times (its timings are its results, never asserted)."""
import pytest

from helpers import load_benchmark

bench = load_benchmark("browser_times")


def test_every_notebook_by_default_and_the_named_ones_in_order():
    every = bench.chosen(None)
    assert every == sorted(every) and every[0].startswith("00_") and len(every) >= 12
    assert bench.chosen(["07", "00"]) == [n for n in every if n[:2] in ("00", "07")]


def test_an_unknown_notebook_is_refused_before_anything_starts():
    with pytest.raises(SystemExit, match="no notebook starts with 99"):
        bench.chosen(["00", "99"])
