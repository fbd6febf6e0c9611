"""The benchmarks' shared method (benchmarks/rounds.py): round orders and spreads."""

import collections
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import rounds  # noqa: E402


@pytest.mark.parametrize("sides", [("a", "b"), ("role", "standby", "job"), ("w", "x", "y", "z")])
def test_each_side_takes_each_place_equally_often_per_block(sides):
    n = len(sides)
    orders = rounds.round_orders(sides, 4 * n, seed=3)
    assert len(orders) == 4 * n
    for block in range(4):
        chunk = orders[block * n:(block + 1) * n]
        assert all(sorted(o) == sorted(sides) for o in chunk)
        for place in range(n):
            assert collections.Counter(o[place] for o in chunk) == {s: 1 for s in sides}


def test_orders_vary_and_are_reproducible():
    sides = ("role", "standby", "job")
    orders = rounds.round_orders(sides, 12, seed=1)
    assert orders == rounds.round_orders(sides, 12, seed=1)
    assert len(set(orders)) > 1
    # Over seeds, the first round's first side is not always the same: no fixed order.
    firsts = {rounds.round_orders(sides, 1, seed=s)[0][0] for s in range(20)}
    assert firsts == set(sides)


def test_two_sides_alternate_first_within_each_pair():
    orders = rounds.round_orders(("fnrl", "torch"), 6, seed=0)
    for i in range(0, 6, 2):
        assert {orders[i][0], orders[i + 1][0]} == {"fnrl", "torch"}


def test_partial_block_and_bad_input():
    assert len(rounds.round_orders(("a", "b", "c"), 4)) == 4
    with pytest.raises(ValueError, match="rounds"):
        rounds.round_orders(("a", "b"), 0)
    with pytest.raises(ValueError, match="distinct"):
        rounds.round_orders(("a", "a"), 2)


def test_spread_median_and_range():
    s = rounds.Spread.of([1.0, 3.0, 2.0, 10.0])
    assert (s.median, s.low, s.high) == (2.5, 1.0, 10.0)
    assert s.contains(1.0) and s.contains(10.0) and not s.contains(10.5)
    assert s.line() == "median 2.50 over 4 rounds (min 1.00, max 10.00; per round 1.00, 3.00, 2.00, 10.00)"
    with pytest.raises(ValueError, match="non-empty"):
        rounds.Spread.of([])


def test_ratios_agree_checks_each_median_against_every_other_spread():
    a = rounds.Spread.of([0.9, 1.0, 1.1])
    b = rounds.Spread.of([0.95, 1.05, 1.2])
    c = rounds.Spread.of([1.3, 1.4, 1.5])
    assert rounds.ratios_agree([a, b]) == [True, True]
    # c's median is outside a's and b's spreads, and theirs are outside c's.
    assert rounds.ratios_agree([a, b, c]) == [False, False, False]


def test_environment_names_cpus_memory_and_versions():
    line = rounds.environment()
    assert "CPUs" in line and "MemAvailable" in line and "numpy" in line
