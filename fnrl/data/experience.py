"""The experience buffer (Laminar seed 000 §3.1, §6): completed, rewarded groups waiting
to be trained on.

Immutable: `add` and `take` return a new buffer. StaleFlow's protocol decides what is
trained: the cycle ranks every occupied (rewarded) group with the configured sampler
(`--coord.sampler`, fnrl.policy.samplers via fnrl.policy.staleness.choose_batch), the
Consume names the chosen groups, and the trainer `take`s exactly those.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

from fnrl.types import Group


@dataclass(frozen=True)
class Experience:
    gid: int
    group: Group
    seq: int          # arrival order

    @property
    def version(self) -> int:
        return self.group.version


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
