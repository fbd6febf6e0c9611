"""Rounds of side-by-side runs (lab.ablation.rounds): every order scheme, spreads and
agreement between runs, as the benchmarks and the ablation grid use them."""

import collections
import math

import pytest

from lab.ablation.rounds import ORDERS, Spread, ratios_agree, round_orders, spread


@pytest.mark.parametrize("sides", [("a", "b"), ("role", "standby", "job"), ("w", "x", "y", "z")])
def test_each_side_takes_each_place_equally_often_per_block(sides):
    n = len(sides)
    orders = round_orders(sides, 4 * n, seed=3)
    assert len(orders) == 4 * n
    for block in range(4):
        chunk = orders[block * n:(block + 1) * n]
        assert all(sorted(o) == sorted(sides) for o in chunk)
        for place in range(n):
            assert collections.Counter(o[place] for o in chunk) == {s: 1 for s in sides}


def test_orders_vary_and_are_reproducible():
    sides = ("role", "standby", "job")
    orders = round_orders(sides, 12, seed=1)
    assert orders == round_orders(sides, 12, seed=1)
    assert len(set(orders)) > 1
    # Over seeds, the first round's first side is not always the same: no fixed order.
    firsts = {round_orders(sides, 1, seed=s)[0][0] for s in range(20)}
    assert firsts == set(sides)


def test_two_sides_alternate_first_within_each_pair():
    orders = round_orders(("fnrl", "torch"), 6, seed=0)
    for i in range(0, 6, 2):
        assert {orders[i][0], orders[i + 1][0]} == {"fnrl", "torch"}


def test_partial_block_and_bad_input():
    assert len(round_orders(("a", "b", "c"), 4)) == 4
    with pytest.raises(ValueError, match="rounds"):
        round_orders(("a", "b"), 0)
    with pytest.raises(ValueError, match="distinct"):
        round_orders(("a", "a"), 2)


def test_spread_median_and_range():
    s = Spread.of([1.0, 3.0, 2.0, 10.0])
    assert (s.median, s.low, s.high) == (2.5, 1.0, 10.0)
    assert s.contains(1.0) and s.contains(10.0) and not s.contains(10.5)
    assert s.line() == "median 2.50 over 4 rounds (min 1.00, max 10.00; per round 1.00, 3.00, 2.00, 10.00)"
    with pytest.raises(ValueError, match="non-empty"):
        Spread.of([])


def test_ratios_agree_checks_each_median_against_every_other_spread():
    a = Spread.of([0.9, 1.0, 1.1])
    b = Spread.of([0.95, 1.05, 1.2])
    c = Spread.of([1.3, 1.4, 1.5])
    assert ratios_agree([a, b]) == [True, True]
    # c's median is outside a's and b's spreads, and theirs are outside c's.
    assert ratios_agree([a, b, c]) == [False, False, False]


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_every_scheme_runs_every_side_once_a_round_and_repeats_on_resume(order):
    sides = ("sync", "fnrl", "laminar", "pipeline")
    orders = round_orders(sides, 7, seed="grid", order=order)
    assert len(orders) == 7 and all(sorted(o) == sorted(sides) for o in orders)
    assert orders == round_orders(sides, 7, seed="grid", order=order)


def test_balanced_reverses_every_other_round_and_rotate_shifts_by_the_round():
    balanced = round_orders(range(3), 4, seed="t", order="balanced")
    assert balanced[1] == balanced[0][::-1] and balanced[3] == balanced[2][::-1]
    assert balanced[2] != balanced[0]
    assert [o[0] for o in round_orders("abc", 4, order="rotate")] == ["a", "b", "c", "a"]
    assert round_orders("abc", 2, order="listed") == [("a", "b", "c")] * 2
    with pytest.raises(ValueError, match="order='random'"):
        round_orders("abc", 2, order="random")


def test_the_report_spread_drops_non_finite_values_and_names_an_empty_one():
    assert spread([3.0, float("nan"), 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0,
                                                    "n": 3}
    empty = spread([float("nan")])
    assert empty["n"] == 0 and math.isnan(empty["median"])
    assert Spread.of([1.0, 2.0]).n == 2
