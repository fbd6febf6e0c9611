"""Rounds of side-by-side runs: the order of each round and the spread of per-round
figures, shared by the ablation grid (lab.ablation.grid, .ablation_report)
and the benchmarks (lab/benchmarks/rounds.py adds the host's environment line).

A shared machine's load comes in bursts. Running side A, then side B, once, lets one
burst decide their ratio. Instead every round runs each side once, in an order that
changes from round to round, a ratio is taken within a round (between figures measured
close in time), and the median of those ratios with its min–max spread says how far one
figure can be trusted. A second run "agrees" when its median lies within the first's
spread (`ratios_agree`).

Orders (`ORDERS`, by name; every one seeded, so a resumed run repeats it):
  blocks    rounds in blocks of len(sides): a block takes one random order of the sides
            and all its rotations, shuffled, so within a block each side is in each
            place once; with two sides the first side alternates in every pair of rounds
  balanced  one seeded shuffle, run backwards in every other round (two rounds give
            every side the same mean position) and rotated by one every two rounds
  shuffle   a fresh seeded shuffle per round
  rotate    the listed order rotated by the round's index
  listed    the listed order in every round
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from collections.abc import Callable, Sequence

Seed = int | str


def _blocks(sides: list, rounds: int, seed: Seed) -> list[list]:
    rng = random.Random(seed)
    out: list[list] = []
    while len(out) < rounds:
        base = list(sides)
        rng.shuffle(base)
        block = [base[i:] + base[:i] for i in range(len(base))]
        rng.shuffle(block)
        out.extend(block)
    return out[:rounds]


def _balanced(sides: list, rounds: int, seed: Seed) -> list[list]:
    base = list(sides)
    random.Random(seed).shuffle(base)
    out = []
    for r in range(rounds):
        # Rotate every two rounds, so each pair of rounds (forwards, backwards) differs.
        shift = (r // 2) % len(base)
        order = base[shift:] + base[:shift]
        out.append(order[::-1] if r % 2 else order)
    return out


def _shuffle(sides: list, rounds: int, seed: Seed) -> list[list]:
    out = []
    for r in range(rounds):
        order = list(sides)
        random.Random(f"{seed}:{r}").shuffle(order)
        out.append(order)
    return out


def _rotate(sides: list, rounds: int, seed: Seed) -> list[list]:
    n = len(sides)
    return [list(sides[r % n:]) + list(sides[:r % n]) for r in range(rounds)]


def _listed(sides: list, rounds: int, seed: Seed) -> list[list]:
    return [list(sides) for _ in range(rounds)]


ORDERS: dict[str, Callable[[list, int, Seed], list[list]]] = {
    "blocks": _blocks, "balanced": _balanced, "shuffle": _shuffle, "rotate": _rotate,
    "listed": _listed}


def round_orders(sides: Sequence, rounds: int, seed: Seed = 0,
                 order: str = "blocks") -> list[tuple]:
    """The order of `sides` in each of `rounds` rounds, by the scheme named `order`
    (module docstring), seeded by `seed` (an int or a name)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    sides = list(sides)
    if len(sides) < 1 or len(set(sides)) != len(sides):
        raise ValueError(f"sides must be distinct and non-empty, got {sides}")
    if order not in ORDERS:
        raise ValueError(f"order={order!r} must be one of {tuple(ORDERS)}")
    return [tuple(o) for o in ORDERS[order](sides, rounds, seed)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Spread:
    """Median and min–max of per-round values."""

    median: float
    low: float
    high: float
    values: tuple[float, ...]

    def __post_init__(self):
        if not self.values:
            raise ValueError("values must be non-empty")

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        """The spread of per-round values (at least one)."""
        if not values:
            raise ValueError("values must be non-empty: no round finished")
        v = tuple(float(x) for x in values)
        return cls(median=statistics.median(v), low=min(v), high=max(v), values=v)

    @property
    def n(self) -> int:
        return len(self.values)

    def contains(self, x: float) -> bool:
        """Whether x lies within [low, high]."""
        return self.low <= x <= self.high

    def line(self, fmt: str = ".2f") -> str:
        """`median M over N rounds (min L, max H; per round a, b, ...)`."""
        per = ", ".join(format(x, fmt) for x in self.values)
        return (f"median {self.median:{fmt}} over {self.n} rounds "
                f"(min {self.low:{fmt}}, max {self.high:{fmt}}; per round {per})")


def spread(values: Sequence[float]) -> dict:
    """The Spread of the finite values as the dict reports and CSVs store: median, min,
    max and n; NaNs and n = 0 when none is finite (a figure no cell recorded)."""
    finite = [float(x) for x in values if math.isfinite(x)]
    if not finite:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    s = Spread.of(finite)
    return {"median": s.median, "min": s.low, "max": s.high, "n": s.n}


def ratios_agree(spreads: Sequence[Spread]) -> list[bool]:
    """For each run's spread, whether its median lies within every other run's spread:
    the test a figure must pass to survive a second run."""
    return [all(o.contains(s.median) for j, o in enumerate(spreads) if j != i)
            for i, s in enumerate(spreads)]
