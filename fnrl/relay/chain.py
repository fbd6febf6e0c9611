"""Pure decisions of the relay tier's controller: chain order, master election, repair,
and a replacement relay joining.

The controller (`fnrl.relay.tier.RelayTier`) observes which relays answer and what version
each holds, calls these functions, and sends each relay its downstream neighbour.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChainPlan:
    """A broadcast chain: `order[0]` is the master; each relay forwards to the next."""

    order: tuple[str, ...]
    epoch: int

    @property
    def master(self) -> str | None:
        return self.order[0] if self.order else None

    def downstream_of(self, name: str) -> str | None:
        i = self.order.index(name)
        return self.order[i + 1] if i + 1 < len(self.order) else None


def detection_window_s(cfg) -> float:
    """Longest the tier's monitor (`fnrl.relay.tier`) takes to splice out a relay that
    stopped answering, from a `RelayConfig`: a round to notice, then `heartbeat_misses`
    rounds of a wait and an unanswered ping."""
    return cfg.heartbeat_s + cfg.heartbeat_misses * (cfg.heartbeat_s + cfg.heartbeat_timeout_s)


def plan_chain(relays: Sequence[str], master: str | None) -> tuple[str, ...]:
    """The chain over `relays`: the master first, then the others in the given order.

    The order of `relays` is the controller's (e.g. by host, so neighbours share a rack);
    removing a relay from it splices its two neighbours, and nothing else moves.
    """
    if len(set(relays)) != len(relays):
        raise ValueError(f"relays={list(relays)}: names repeat")
    if master is None or master not in relays:
        return tuple(relays)
    return (master, *(r for r in relays if r != master))


def elect_master(candidates: Sequence[str], versions: Mapping[str, int | None]) -> str | None:
    """The candidate holding the newest complete version (it can re-broadcast it at once);
    the earliest in chain order among equals. None if there are no candidates."""
    if not candidates:
        return None
    newest = max(-1 if versions.get(c) is None else versions[c] for c in candidates)
    return next(c for c in candidates if (-1 if versions.get(c) is None else versions[c]) == newest)


def repair(plan: ChainPlan, alive: Sequence[str], versions: Mapping[str, int | None]) -> ChainPlan:
    """The chain after dropping relays not in `alive`: neighbours of a dead relay are spliced;
    a dead master is replaced by `elect_master` over the survivors. Same plan if nothing died."""
    survivors = [r for r in plan.order if r in set(alive)]
    if tuple(survivors) == plan.order:
        return plan
    master = plan.master if plan.master in survivors else elect_master(survivors, versions)
    return ChainPlan(order=plan_chain(survivors, master), epoch=plan.epoch + 1)


class AlreadyInChain(ValueError):
    """A relay asked to join a chain it is already part of."""


def join(plan: ChainPlan, relay: str) -> ChainPlan:
    """The chain with `relay` (a replacement) appended at the tail, in a new epoch.

    At the tail, because a newcomer holds nothing yet: it catches up from the old tail
    by the chain's normal forwarding (the old tail's newest version goes to its new
    downstream), and no survivor ever waits on a relay still being filled. Put in its
    old place, it would stand between two relays that already hold every version, and
    the relays behind it would receive the next versions only through it; should it
    fail while catching up, they would be spliced again. A relay that joins an empty
    chain becomes its master."""
    if relay in plan.order:
        raise AlreadyInChain(f"relay {relay!r} is already in the chain {list(plan.order)}")
    return ChainPlan(order=(*plan.order, relay), epoch=plan.epoch + 1)
