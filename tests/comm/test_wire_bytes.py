"""The counted wire bytes: one exact table of ring factors (``collectives.WIRE_FACTOR``), rounded down once.

The counters, the tensor-parallel volumes and the dry run's analytic counts all read the table, so these
checks are on the arithmetic itself: exact fractions, floored once per call, with no float anywhere.
"""
from fractions import Fraction

import pytest

from labkit.comm.collectives import WIRE_FACTOR, wire_bytes, wire_exact
from labkit.comm.network import collective_cost


@pytest.mark.parametrize("p", [2, 3, 7, 8, 1000, 1024])
def test_the_table_is_the_ring_formulas_as_exact_fractions(p):
    assert WIRE_FACTOR["all_reduce"](p) == Fraction(2 * (p - 1), p)
    assert WIRE_FACTOR["reduce_scatter"](p) == WIRE_FACTOR["all_gather"](p) == Fraction(p - 1, p)
    assert WIRE_FACTOR["broadcast"](p) == WIRE_FACTOR["send"](p) == 1 and WIRE_FACTOR["recv"](p) == 0


def test_bytes_are_the_floor_of_the_exact_product_taken_once():
    assert wire_exact("all_gather", 10, 3) == Fraction(20, 3) and wire_bytes("all_gather", 10, 3) == 6
    assert wire_bytes("all_reduce", 10, 3) == 13  # ⌊40/3⌋, not 2·⌊20/3⌋ = 12
    assert wire_bytes("all_reduce", 10, 1) == 0 and wire_exact("broadcast", 10, 1) == 0  # a group of one: nothing
    # integer arithmetic at any size: a float factor, (p−1)/p·n truncated, is off here by two bytes
    n = 3 * 2**55 + 3
    assert wire_bytes("all_gather", n, 3) == 2 * n // 3 != int((3 - 1) / 3 * n)


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather"])
@pytest.mark.parametrize("p", [2, 4, 8, 1024])
def test_the_ring_s_counted_bytes_are_the_emulated_ring_s_bytes(op, p):
    # the same ring passes: what one rank sends is what goes through the busiest link (not so for broadcast,
    # counted as the root's one send; the emulated ring broadcasts by a scatter then an all-gather)
    assert collective_cost(op, 4096, p, "ring").bytes == wire_exact(op, 4096, p)
