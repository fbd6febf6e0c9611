"""Which rewarded groups a Consume trains, chosen by registered name (`--coord.sampler`).

A sampler ranks items with an arrival order `seq` and a policy `version` and returns
the positions of the n to train on, in batch order. The cycle ranks every occupied
staleness entry with it (staleness.choose_batch). "fifo": arrival order (Laminar's
default in its experiments); "oldest_version": stalest first, so fewer groups age past
a staleness bound; "protocol": the items as listed, which in staleness.choose_batch is
the head buffer as StaleFlow's protocol filled it (§4.2), i.e. no sampler at all.
"""

from __future__ import annotations

from typing import Callable, Protocol


class Ranked(Protocol):
    """What a sampler reads: a staleness Entry (fnrl.policy.staleness) or any item with
    a version and an arrival order."""

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


def _protocol(items: tuple[Ranked, ...], n: int) -> tuple[int, ...]:
    return tuple(range(min(n, len(items))))


SAMPLERS: dict[str, Sampler] = {"fifo": _fifo, "oldest_version": _oldest_version,
                                "protocol": _protocol}
