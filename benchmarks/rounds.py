"""The method every side-by-side benchmark shares: rounds of all sides in varying order,
a ratio per round, and the median with its min–max spread, beside the environment.

A shared machine's load comes in bursts. A benchmark that runs side A, then side B,
once, lets one burst decide their ratio. Here every round runs each side once, in an
order that changes from round to round (each side takes each place equally often over a
block of rounds, and the blocks are shuffled, so no side is always first or always
follows the same neighbour); a round's ratio compares sides measured within minutes of
each other, and the spread of those ratios says how far one figure can be trusted.
Pure helpers (`round_orders`, `Spread`, `ratios_agree`) are unit-tested in
tests/benchmarks/test_rounds.py; `environment` and `load` read the host.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import random
import statistics
from collections.abc import Sequence


def round_orders(sides: Sequence[str], rounds: int, seed: int = 0) -> list[tuple[str, ...]]:
    """The order of `sides` in each of `rounds` rounds.

    Rounds come in blocks of len(sides): a block takes one random order of the sides and
    all its rotations, shuffled, so within a block each side is in each place once. With
    two sides this alternates which side goes first across every pair of rounds.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if len(sides) < 1 or len(set(sides)) != len(sides):
        raise ValueError(f"sides must be distinct and non-empty, got {list(sides)}")
    rng = random.Random(seed)
    out: list[tuple[str, ...]] = []
    while len(out) < rounds:
        base = list(sides)
        rng.shuffle(base)
        block = [tuple(base[i:] + base[:i]) for i in range(len(base))]
        rng.shuffle(block)
        out.extend(block)
    return out[:rounds]


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

    def contains(self, x: float) -> bool:
        """Whether x lies within [low, high]."""
        return self.low <= x <= self.high

    def line(self, fmt: str = ".2f") -> str:
        """`median M over N rounds (min L, max H; per round a, b, ...)`."""
        per = ", ".join(format(x, fmt) for x in self.values)
        return (f"median {self.median:{fmt}} over {len(self.values)} rounds "
                f"(min {self.low:{fmt}}, max {self.high:{fmt}}; per round {per})")


def ratios_agree(spreads: Sequence[Spread]) -> list[bool]:
    """For each run's spread, whether its median lies within every other run's spread:
    the test a figure must pass to survive a second run."""
    return [all(o.contains(s.median) for j, o in enumerate(spreads) if j != i)
            for i, s in enumerate(spreads)]


def load() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def mem_available_mb() -> float:
    """MemAvailable from /proc/meminfo, in MB."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("nan")


_PACKAGES = ("numpy", "jax", "jaxlib", "torch", "transformers", "vllm", "ucxx")
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "XLA_FLAGS")


def environment() -> str:
    """One line: CPUs (all and allowed), load, MemAvailable, thread variables, versions.
    Versions come from package metadata, so nothing heavy is imported to print them."""
    versions = []
    for name in _PACKAGES:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    threads = " ".join(f"{k}={os.environ[k]!r}" for k in _THREAD_VARS if k in os.environ)
    return (f"env: {os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} allowed), load {load()}, "
            f"MemAvailable {mem_available_mb():.0f} MB, {threads or 'no thread variables set'}; "
            f"{', '.join(versions)}")
