"""The experience buffer (Laminar seed 000 §3.1, §6): completed, rewarded groups waiting
to be trained on, with pluggable sampling chosen by registered name.

Immutable: `add`, `sample` and `take` return a new buffer. Samplers: "fifo" (Laminar's
default in its experiments) or "oldest_version" (stalest first, so fewer groups age
past a staleness bound). In the live loop StaleFlow's protocol decides what is trained:
the cycle ranks every occupied (rewarded) group with the configured sampler
(`--coord.sampler`, fnrl.policy.staleness.choose_batch), the Consume names the chosen
groups, and the trainer `take`s exactly those. `sample` serves loops without the
protocol.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

from fnrl.types import Group


@dataclass(frozen=True)
class Experience:
    gid: int
    group: Group
    seq: int          # arrival order

    @property
    def version(self) -> int:
        return self.group.version


class Ranked(Protocol):
    """What a sampler reads: an Experience, or a staleness Entry (fnrl.policy.staleness)."""

    @property
    def version(self) -> int: ...

    @property
    def seq(self) -> int: ...


Sampler = Callable[[tuple[Ranked, ...], int], tuple[int, ...]]
"""(items, n) -> positions of the n items to train on, in batch order."""


def _fifo(items: tuple[Ranked, ...], n: int) -> tuple[int, ...]:
    order = sorted(range(len(items)), key=lambda i: items[i].seq)
    return tuple(order[:n])


def _oldest_version(items: tuple[Ranked, ...], n: int) -> tuple[int, ...]:
    order = sorted(range(len(items)), key=lambda i: (items[i].version, items[i].seq))
    return tuple(order[:n])


SAMPLERS: dict[str, Sampler] = {"fifo": _fifo, "oldest_version": _oldest_version}


@dataclass(frozen=True)
class ExperienceBuffer:
    items: tuple[Experience, ...] = ()
    capacity: int | None = None
    """When full, the oldest arrivals are evicted (Laminar §3.1 leaves eviction to the
    user; arrival order is the simplest policy that never starves new data)."""
    next_seq: int = 0

    def __post_init__(self):
        if self.capacity is not None and self.capacity <= 0:
            raise ValueError(f"ExperienceBuffer.capacity={self.capacity!r}: must be > 0")

    def __len__(self) -> int:
        return len(self.items)


def add(buf: ExperienceBuffer, groups: Iterable[tuple[int, Group]]
        ) -> tuple[ExperienceBuffer, tuple[Experience, ...]]:
    """Append (gid, group) pairs; returns the new buffer and what was evicted."""
    items, seq = list(buf.items), buf.next_seq
    for gid, group in groups:
        items.append(Experience(gid, group, seq))
        seq += 1
    evicted: tuple[Experience, ...] = ()
    if buf.capacity is not None and len(items) > buf.capacity:
        cut = len(items) - buf.capacity
        evicted, items = tuple(items[:cut]), items[cut:]
    return dataclasses.replace(buf, items=tuple(items), next_seq=seq), evicted


def sample(buf: ExperienceBuffer, n: int, sampler: str = "fifo"
           ) -> tuple[tuple[Experience, ...], ExperienceBuffer]:
    """Remove and return up to n items chosen by the named sampler."""
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; registered: {sorted(SAMPLERS)}")
    picked = SAMPLERS[sampler](buf.items, n)
    chosen = set(picked)
    if len(chosen) != len(picked) or not all(0 <= i < len(buf.items) for i in picked):
        raise ValueError(f"sampler {sampler!r} returned invalid positions {picked}")
    rest = tuple(x for i, x in enumerate(buf.items) if i not in chosen)
    return tuple(buf.items[i] for i in picked), dataclasses.replace(buf, items=rest)


def take(buf: ExperienceBuffer, gids: Iterable[int]
         ) -> tuple[tuple[Experience, ...], ExperienceBuffer]:
    """Remove and return exactly these groups (a Consume's batch), in the given order."""
    gids = tuple(gids)
    by_gid = {x.gid: x for x in buf.items}
    missing = [g for g in gids if g not in by_gid]
    if missing:
        raise KeyError(f"groups {missing} are not in the experience buffer")
    wanted = set(gids)
    rest = tuple(x for x in buf.items if x.gid not in wanted)
    return tuple(by_gid[g] for g in gids), dataclasses.replace(buf, items=rest)


def discard(buf: ExperienceBuffer, gids: Iterable[int]) -> ExperienceBuffer:
    """Forget groups that will never be trained on (aborted by the staleness manager)."""
    gone = set(gids)
    return dataclasses.replace(buf, items=tuple(x for x in buf.items if x.gid not in gone))
