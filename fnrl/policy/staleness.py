"""StaleFlow's global consistency protocol (seed 001 §4): virtual staleness buffers.

A buffer with version V_buf holds the entries of the groups the trainer will use to go
from V_buf to V_buf + 1. Every entry carries V (the oldest policy version tolerated for
its group) and the protocol keeps, for every entry in every buffer,

    V + η ≥ V_buf                                                      (§4.2)

Entries are per group (§4.3 "Group sampling"): a group is reserved when its first
member starts, occupied when all members are finished and rewarded, and its V is the
minimum over its members. Gap (digest gap 2): the paper does not say how the minimum
evolves when members start on instances of different versions at different times. We
fix V at the first member's admission and route every later member only to instances
serving a version ≥ V (the rule §5.3 uses for partial trajectories), so the minimum
over the group's tokens is V by construction and the reservation never has to move.

The state is immutable: tuples of `Entry` per buffer. Batch operations (`reserve_many`,
`occupy_many`) copy once into a working list, apply, and freeze again, so a decision
cycle that admits hundreds of groups pays one copy, not one per group.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple, Sequence


class NotAdmissible(ValueError):
    """Reserve found no empty entry in the window [V, V + η] (§4.2 discriminator)."""


class BufferState(enum.Enum):
    # §4.2 "Buffer states".
    WAITING = "waiting"  # has empty entries; Reserve may continue
    READY = "ready"      # full, all occupied: training may Consume it
    STUCK = "stuck"      # full, some reserved: blocks training and reservations


class Entry(NamedTuple):
    gid: int
    version: int      # V of the group (§4.1)
    occupied: bool    # False: reserved
    seq: int = -1     # occupation order (arrival into the experience buffer); -1: reserved


@dataclass(frozen=True, kw_only=True)
class StalenessConfig:
    eta: int = 1
    """Staleness bound η: train only on groups at most η versions old (§2, §4.2)."""
    batch_size: int
    """Entries per buffer = groups per training step (§4.2: capacity = batch size)."""
    stuck_timeout_s: float | None = None
    """Abort the reserved groups of a head buffer Stuck for this long (§4.3 filtering:
    "when training is stalled waiting for excessively delayed trajectories"). Gap (digest
    gap 3): the paper gives no threshold; None (off) matches its evaluation, which
    disables abort-based filtering."""

    def __post_init__(self):
        if self.eta < 0:
            raise ValueError(f"StalenessConfig.eta={self.eta!r}: must be >= 0")
        if self.batch_size <= 0:
            raise ValueError(f"StalenessConfig.batch_size={self.batch_size!r}: must be > 0")
        if self.stuck_timeout_s is not None and self.stuck_timeout_s <= 0:
            raise ValueError(f"StalenessConfig.stuck_timeout_s={self.stuck_timeout_s!r}: "
                             "must be > 0 or None")


@dataclass(frozen=True)
class StalenessState:
    """Buffers V_buf = v_train .. v_train + η (at most (η+1) × batch_size entries, §4.2)."""

    eta: int
    capacity: int
    v_train: int                                 # version of the next buffer to Consume
    buffers: tuple[tuple[Entry, ...], ...]       # buffers[k] has V_buf = v_train + k
    next_seq: int = 0                            # `seq` of the next Occupy

    def buffer_version(self, k: int) -> int:
        return self.v_train + k


def init_staleness(cfg: StalenessConfig, v_train: int = 0) -> StalenessState:
    return StalenessState(cfg.eta, cfg.batch_size, v_train, ((),) * (cfg.eta + 1))


def buffer_state(state: StalenessState, k: int) -> BufferState:
    buf = state.buffers[k]
    if len(buf) < state.capacity:
        return BufferState.WAITING
    return BufferState.READY if all(e.occupied for e in buf) else BufferState.STUCK


def empty_counts(state: StalenessState) -> list[int]:
    return [state.capacity - len(b) for b in state.buffers]


def window(state: StalenessState, version: int) -> range:
    """Buffer indices a group with V = version may live in: V_buf ∈ [V, V + η] (§4.2)."""
    lo = max(version, state.v_train) - state.v_train
    hi = version + state.eta - state.v_train
    return range(lo, max(lo, hi + 1))


def reserve_slot(empties: list[int], state: StalenessState, version: int) -> int | None:
    """Backward scan from V + η down to V for the latest buffer with an empty entry
    (§4.2 Reserve, worst case). Reads only the empty counts, so the router can probe it
    against counts it updates itself within one cycle."""
    if version > state.v_train:
        return None  # no trajectory can come from a version the trainer has not reached
    for k in reversed(window(state, version)):
        if empties[k] > 0:
            return k
    return None


def can_reserve(state: StalenessState, version: int) -> bool:
    """The discriminator: a simulated Reserve (§4.2 "As a discriminator")."""
    return reserve_slot(empty_counts(state), state, version) is not None


def group_versions(state: StalenessState) -> dict[int, int]:
    """V of every tracked group (reserved or occupied)."""
    return {e.gid: e.version for buf in state.buffers for e in buf}


class _Work:
    """A mutable working copy, used inside one batch operation and frozen after."""

    def __init__(self, state: StalenessState):
        self.state = state
        self.bufs = [list(b) for b in state.buffers]
        self.next_seq = state.next_seq
        self._where: dict[int, int] | None = None

    @property
    def where(self) -> dict[int, int]:
        # Built on first use: a batch of Reserves alone never needs it.
        if self._where is None:
            self._where = {e.gid: k for k, buf in enumerate(self.bufs) for e in buf}
        return self._where

    def freeze(self) -> StalenessState:
        return dataclasses.replace(self.state, buffers=tuple(tuple(b) for b in self.bufs),
                                   next_seq=self.next_seq)

    def put(self, k: int, entry: Entry) -> None:
        self.bufs[k].append(entry)
        if self._where is not None:
            self._where[entry.gid] = k

    def take(self, gid: int) -> tuple[int, Entry]:
        k = self.where.pop(gid)
        buf = self.bufs[k]
        i = next(i for i, e in enumerate(buf) if e.gid == gid)
        return k, buf.pop(i)

    def reserve(self, gid: int, version: int) -> None:
        if gid in self.where:
            raise ValueError(f"group {gid} is already tracked")
        empties = [self.state.capacity - len(b) for b in self.bufs]
        k = reserve_slot(empties, self.state, version)
        if k is None:
            raise NotAdmissible(f"no empty entry for V={version} in buffers "
                                f"{self.state.v_train}..{self.state.v_train + self.state.eta}")
        self.put(k, Entry(gid, version, False))

    def occupy(self, gid: int) -> None:
        k, a = self.take(gid)
        if a.occupied:
            raise ValueError(f"group {gid} is already occupied")
        eta, v_train = self.state.eta, self.state.v_train
        # §4.2 "Entry deletion and movement", steps (2)-(3). Gap (digest gap 1): the
        # paper's step (3) ("if B's original buffer then exposes a smaller reserved entry
        # C ...") is ambiguous; we read it as a chain: the hole left by A is filled by the
        # earliest reserved entry that may legally live there, which moves the hole to an
        # earlier buffer, and so on. Reserved entries drift late, holes drift early.
        hole = k
        while True:
            found = None
            for j in range(hole):
                for i, e in enumerate(self.bufs[j]):
                    if not e.occupied and e.version + eta >= v_train + hole:
                        found = (j, i)
                        break
                if found:
                    break
            if found is None:
                break
            j, i = found
            b = self.bufs[j].pop(i)
            self.put(hole, b)
            hole = j
        # Step (4): Occupy greedily at the earliest empty entry (forward scan). It is at or
        # before A's old buffer, so V_A + η ≥ V_buf still holds.
        first = next(j for j, buf in enumerate(self.bufs) if len(buf) < self.state.capacity)
        self.put(first, Entry(gid, a.version, True, self.next_seq))
        self.next_seq += 1

    def abort(self, gid: int) -> None:
        k, _ = self.take(gid)
        # §4.3: "occupied entries from later buffers can be moved forward to fill the
        # empty slot, allowing the buffer to become Ready quickly". Moving earlier never
        # breaks V + η ≥ V_buf. We chain it so holes drift to the latest buffers.
        hole = k
        while True:
            found = None
            for j in range(hole + 1, len(self.bufs)):
                i = next((i for i, e in enumerate(self.bufs[j]) if e.occupied), None)
                if i is not None:
                    found = (j, i)
                    break
            if found is None:
                return
            j, i = found
            self.put(hole, self.bufs[j].pop(i))
            hole = j


def reserve_many(state: StalenessState, admissions: Iterable[tuple[int, int]]) -> StalenessState:
    """Reserve each (gid, V) in order; raises NotAdmissible if one does not fit."""
    work = _Work(state)
    for gid, version in admissions:
        work.reserve(gid, version)
    return work.freeze()


def reserve(state: StalenessState, gid: int, version: int) -> StalenessState:
    """§4.2 Reserve: the latest empty entry in buffers V + η down to V."""
    return reserve_many(state, [(gid, version)])


def occupy_many(state: StalenessState, gids: Iterable[int]) -> StalenessState:
    work = _Work(state)
    for gid in gids:
        work.occupy(gid)
    return work.freeze()


def occupy(state: StalenessState, gid: int) -> StalenessState:
    """§4.2 Occupy: delete the group's reserved entry (with entry movement), then occupy
    the earliest empty entry. Call when every member is finished and rewarded."""
    return occupy_many(state, [gid])


def abort_many(state: StalenessState, gids: Iterable[int]) -> StalenessState:
    work = _Work(state)
    for gid in gids:
        work.abort(gid)
    return work.freeze()


def abort(state: StalenessState, gid: int) -> StalenessState:
    """§4.3 Abort: drop a group's entry, reserved or occupied, for good."""
    return abort_many(state, [gid])


def choose_batch(state: StalenessState,
                 rank: Callable[[tuple[Entry, ...]], Sequence[int]]) -> StalenessState:
    """Refill a Ready head buffer with the occupied groups `rank` puts first.

    `rank(entries)` orders every occupied entry in the buffers, best first (a sampler of
    fnrl.policy.samplers over `seq` and `version`). Any occupied entry may be trained now
    (V ≤ v_train ≤ V + η), but one leaving the head must land in a later buffer it may
    live in (V + η ≥ V_buf), in a slot an occupied entry vacated, so every buffer keeps
    its counts and state. Gap: the paper trains the head as the protocol filled it; we
    let a sampler choose among every rewarded group (digest: experience buffer, seed
    000 §3.1). The choice is the greedy basis of a transversal matroid (entries that
    stay later, chosen worst first while they still fit), so it is the best head the
    ranking admits, position by position.
    """
    if buffer_state(state, 0) is not BufferState.READY:
        return state
    cands = [(k, e) for k, buf in enumerate(state.buffers) for e in buf if e.occupied]
    entries = tuple(e for _, e in cands)
    order = list(rank(entries))
    if sorted(order) != list(range(len(entries))):
        raise ValueError(f"rank returned {order}, not an ordering of {len(entries)} entries")
    size, eta = state.capacity, state.eta
    if set(order[:size]) == set(range(size)):   # the head already holds the best groups
        head = tuple(entries[i] for i in order[:size])
        return dataclasses.replace(state, buffers=(head,) + state.buffers[1:])
    # level: the latest later buffer an entry may move to (V + η ≥ v_train + level).
    level = [min(e.version + eta - state.v_train, eta) for e in entries]
    slots = [0] + [sum(e.occupied for e in buf) for buf in state.buffers[1:]]
    slack = list(itertools.accumulate(slots))      # slack[K]: free later slots in 1..K
    later: list[int] = []
    for i in reversed(order):
        if len(later) == len(entries) - size:
            break
        if level[i] >= 1 and min(slack[level[i]:]) >= 1:
            for k in range(level[i], eta + 1):
                slack[k] -= 1
            later.append(i)
    stay = set(later)
    head = tuple(entries[i] for i in order if i not in stay)
    assert len(head) == size, "the current placement is feasible, so greedy fills the rest"
    rank_of = {i: r for r, i in enumerate(order)}
    queue = sorted(later, key=lambda i: (level[i], rank_of[i]))  # most constrained first
    bufs, at = [head], 0
    for k in range(1, eta + 1):
        bufs.append(tuple(e for e in state.buffers[k] if not e.occupied)
                    + tuple(entries[i] for i in queue[at:at + slots[k]]))
        at += slots[k]
    return dataclasses.replace(state, buffers=tuple(bufs))


def consume(state: StalenessState) -> tuple[StalenessState, tuple[Entry, ...]]:
    """§4.2 Consume: retire the head buffer, which must be Ready."""
    if buffer_state(state, 0) is not BufferState.READY:
        raise ValueError(f"buffer {state.v_train} is {buffer_state(state, 0).value}, not ready")
    batch = state.buffers[0]
    return (dataclasses.replace(state, v_train=state.v_train + 1,
                                buffers=state.buffers[1:] + ((),)), batch)


def step_skipped(state: StalenessState) -> StalenessState:
    """The trainer consumed the head buffer without updating (a non-finite loss skips
    the step), so its version did not advance: every buffer moves one version down.
    No entry can break the bound by it (each had V + η ≥ V_buf, now V_buf is one
    less), and none sits below its window (V ≤ the trainer's version, which is the new
    head's V_buf). Gap: StaleFlow assumes every Consume makes a new version."""
    return dataclasses.replace(state, v_train=state.v_train - 1)

