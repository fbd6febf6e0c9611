"""StaleFlow's staleness buffers (seed 001 §4): golden timeline and random schedules."""

import itertools

import pytest
from hypothesis import given, settings, strategies as hst

from fnrl.policy import staleness as st
from fnrl.policy.samplers import SAMPLERS
from fnrl.policy.staleness import BufferState, NotAdmissible, StalenessConfig


def layout(state):
    """Buffers as {V_buf: [(gid, 'O'|'R'), ...]}."""
    return {state.v_train + k: [(e.gid, "O" if e.occupied else "R") for e in buf]
            for k, buf in enumerate(state.buffers)}


def test_fig7_timeline():
    """StaleFlow Fig. 7 (η = 1). The figure is an image the text only describes, so this
    timeline is built to pass through every state the text names, with buffers computed
    by hand: worst-case Reserve (T1), greedy Occupy (T1'), V1..V2 Waiting so trajectory 7
    still gets V_traj = V1 (T2), then V2 Stuck refusing V1 while V3 admits V2, and a
    partial rollout of trajectory 5 that leaves its reserved entry in V2 unchanged (T2')."""
    s = st.init_staleness(StalenessConfig(eta=1, batch_size=3), v_train=1)
    # T1: trajectories 1, 2 start with V_traj = V1: backward scan from V1 + η = V2.
    s = st.reserve(st.reserve(s, 1, 1), 2, 1)
    assert layout(s) == {1: [], 2: [(1, "R"), (2, "R")]}
    # T1': 1 finishes: its reserved entry goes, Occupy takes the earliest empty (V1).
    s = st.occupy(s, 1)
    assert layout(s) == {1: [(1, "O")], 2: [(2, "R")]}
    # T2: V1 and V2 are Waiting, so trajectory 7 may still get V_traj = V1.
    assert [st.buffer_state(s, k) for k in (0, 1)] == [BufferState.WAITING] * 2
    assert st.can_reserve(s, 1)
    s = st.reserve(s, 7, 1)
    s = st.reserve(s, 5, 1)        # on instance 2, also V1: V2 is now full
    s = st.reserve(s, 3, 1)        # V2 full: the scan goes back to V1
    assert layout(s) == {1: [(1, "O"), (3, "R")], 2: [(2, "R"), (7, "R"), (5, "R")]}
    assert st.buffer_state(s, 1) is BufferState.STUCK
    # 2 finishes. Entry movement: the earliest reserved entry that may live in V2 (3,
    # from V1) moves into 2's place, and 2 is occupied early, in V1.
    s = st.occupy(s, 2)
    assert layout(s) == {1: [(1, "O"), (2, "O")], 2: [(7, "R"), (5, "R"), (3, "R")]}
    s = st.occupy(s, 3)
    assert layout(s) == {1: [(1, "O"), (2, "O"), (3, "O")], 2: [(7, "R"), (5, "R")]}
    assert st.buffer_state(s, 0) is BufferState.READY
    s, batch = st.consume(s)
    assert [e.gid for e in batch] == [1, 2, 3] and s.v_train == 2
    # Trajectory 8 takes V2's last entry with V_traj = V1: V2 is Stuck.
    s = st.reserve(s, 8, 1)
    assert st.buffer_state(s, 0) is BufferState.STUCK
    # T2': V2 Stuck blocks V_traj = V1 (its window is V2 alone now); V3 admits V2.
    assert not st.can_reserve(s, 1)
    assert st.can_reserve(s, 2)
    with pytest.raises(NotAdmissible):
        st.reserve(s, 10, 1)
    # A partial rollout of 5 (interrupt, pull V2, resume) has no buffer operation at all;
    # test_cycle.test_sync_interrupt_keeps_reservations checks that at the cycle level.
    s = st.reserve(s, 9, 2)
    assert layout(s) == {2: [(7, "R"), (5, "R"), (8, "R")], 3: [(9, "R")]}
    with pytest.raises(ValueError, match="stuck"):
        st.consume(s)


def test_abort_moves_occupied_entries_forward():
    s = st.init_staleness(StalenessConfig(eta=2, batch_size=2), v_train=0)
    for gid in (1, 2, 3, 4):
        s = st.reserve(s, gid, 0)  # 1, 2 -> V2; 3, 4 -> V1
    s = st.occupy_many(s, [1, 2])  # moves 3, 4 late; 1, 2 occupy V0
    assert layout(s) == {0: [(1, "O"), (2, "O")], 1: [], 2: [(3, "R"), (4, "R")]}
    s = st.occupy(s, 3)
    s = st.abort(s, 1)             # 3 (occupied, V1) moves forward into V0
    assert layout(s) == {0: [(2, "O"), (3, "O")], 1: [], 2: [(4, "R")]}
    assert st.buffer_state(s, 0) is BufferState.READY


def test_no_version_from_the_future():
    s = st.init_staleness(StalenessConfig(eta=1, batch_size=2), v_train=0)
    assert not st.can_reserve(s, 1)


def test_config_validation():
    with pytest.raises(ValueError, match="eta=-1"):
        StalenessConfig(eta=-1, batch_size=2)
    with pytest.raises(ValueError, match="batch_size=0"):
        StalenessConfig(eta=1, batch_size=0)


@settings(max_examples=150, deadline=None)
@given(eta=hst.integers(0, 3), batch=hst.integers(1, 4),
       ops=hst.lists(hst.tuples(hst.sampled_from("RRROAC"), hst.integers(0, 50)), max_size=80))
def test_random_primitive_schedules(eta, batch, ops):
    """Over any schedule of Reserve / Occupy / Abort / Consume: the bound holds for every
    entry, capacities hold, no group is tracked twice, and every consumed group had
    V + η ≥ V_buf and is consumed once."""
    s = st.init_staleness(StalenessConfig(eta=eta, batch_size=batch))
    reserved, occupied, consumed = set(), set(), set()
    next_gid = 0
    for op, x in ops:
        if op == "R":
            v = s.v_train - (x % (eta + 2))   # sometimes too stale to admit
            if st.can_reserve(s, v):
                s = st.reserve(s, next_gid, v)
                reserved.add(next_gid)
            else:
                with pytest.raises(NotAdmissible):
                    st.reserve(s, next_gid, v)
            next_gid += 1
        elif op == "O" and reserved:
            g = sorted(reserved)[x % len(reserved)]
            s = st.occupy(s, g)
            reserved.discard(g)
            occupied.add(g)
        elif op == "A" and (reserved or occupied):
            pool = sorted(reserved | occupied)
            g = pool[x % len(pool)]
            s = st.abort(s, g)
            reserved.discard(g)
            occupied.discard(g)
        elif op == "C" and st.buffer_state(s, 0) is BufferState.READY:
            v_buf = s.v_train
            s, batch_entries = st.consume(s)
            for e in batch_entries:
                assert e.occupied and e.version + eta >= v_buf
                assert e.gid not in consumed
                consumed.add(e.gid)
                occupied.discard(e.gid)
        tracked = {}
        for k, buf in enumerate(s.buffers):
            assert len(buf) <= batch
            for e in buf:
                assert e.version + eta >= s.v_train + k
                assert e.gid not in tracked
                tracked[e.gid] = e.occupied
        assert {g for g, o in tracked.items() if not o} == reserved
        assert {g for g, o in tracked.items() if o} == occupied


def _state(v_train, eta, capacity, buffers):
    """A state from [(gid, V, 'O'|'R', seq)] per buffer."""
    return st.StalenessState(eta, capacity, v_train, tuple(
        tuple(st.Entry(g, v, kind == "O", seq) for g, v, kind, seq in buf) for buf in buffers))


def _rank(sampler):
    return lambda entries: SAMPLERS[sampler](entries, len(entries))


def test_choose_batch_by_sampler():
    # η = 2, V_train = 2. The head holds X (V1) and Y, both occupied after Z and W, which
    # wait in V4; V3 holds only reservations. FIFO wants Z and W, but X (V1) may not live
    # in V4 (1 + 2 < 4), so X stays and only Y leaves: Z and X train now.
    s = _state(2, 2, 2, [[(1, 1, "O", 5), (2, 2, "O", 6)],
                         [(3, 1, "R", -1), (4, 2, "R", -1)],
                         [(5, 2, "O", 0), (6, 2, "O", 1)]])
    fifo = st.choose_batch(s, _rank("fifo"))
    assert layout(fifo) == {2: [(5, "O"), (1, "O")], 3: [(3, "R"), (4, "R")],
                            4: [(6, "O"), (2, "O")]}
    # Oldest version first: X (V1) leads, then the earliest V2 arrival, Z.
    assert [e.gid for e in st.choose_batch(s, _rank("oldest_version")).buffers[0]] == [1, 5]
    # An old group that arrived last: FIFO keeps the head, oldest_version takes it.
    s = _state(2, 2, 2, [[(1, 2, "O", 0), (2, 2, "O", 1)],
                         [(3, 1, "O", 2), (4, 2, "R", -1)],
                         []])
    assert st.choose_batch(s, _rank("fifo")) == s
    old = st.choose_batch(s, _rank("oldest_version"))
    assert layout(old) == {2: [(3, "O"), (1, "O")], 3: [(4, "R"), (2, "O")], 4: []}
    # Not Ready: nothing to choose.
    stuck = _state(2, 1, 1, [[(1, 2, "R", -1)], [(2, 2, "O", 0)]])
    assert st.choose_batch(stuck, _rank("oldest_version")) == stuck


def _legal_states():
    @hst.composite
    def build(draw):
        eta, cap, v_train = draw(hst.integers(1, 3)), draw(hst.integers(1, 3)), 5
        bufs, seqs = [], iter(draw(hst.permutations(range(cap * (eta + 1)))))
        for k in range(eta + 1):
            n = cap if k == 0 else draw(hst.integers(0, cap))
            buf = []
            for _ in range(n):
                occupied = k == 0 or draw(hst.booleans())
                v = draw(hst.integers(v_train + k - eta, v_train))
                buf.append((len(bufs) * 10 + len(buf), v, "O" if occupied else "R",
                            next(seqs) if occupied else -1))
            bufs.append(buf)
        return _state(v_train, eta, cap, bufs)
    return build()


@settings(max_examples=200, deadline=None)
@given(s=_legal_states(), sampler=hst.sampled_from(sorted(SAMPLERS)))
def test_choose_batch_is_legal_and_best(s, sampler):
    """The bound holds everywhere, each buffer keeps its reserved entries and occupied
    count, no entry is lost, and the head is the best the ranking admits: its sorted
    rank positions are lexicographically least among every legal head (brute force)."""
    out = st.choose_batch(s, _rank(sampler))
    for k, (old, new) in enumerate(zip(s.buffers, out.buffers)):
        assert [e for e in old if not e.occupied] == [e for e in new if not e.occupied]
        assert sum(e.occupied for e in old) == sum(e.occupied for e in new)
        assert all(e.version + s.eta >= s.v_train + k for e in new)
    occ = [e for buf in s.buffers for e in buf if e.occupied]
    assert sorted(e for buf in out.buffers for e in buf if e.occupied) == sorted(occ)
    order = _rank(sampler)(tuple(occ))
    pos = {occ[i].gid: r for r, i in enumerate(order)}
    slots = [sum(e.occupied for e in buf) for buf in s.buffers]

    def legal(head):
        rest = sorted(min(e.version + s.eta - s.v_train, s.eta) for e in occ if e not in head)
        targets = [k for k in range(1, s.eta + 1) for _ in range(slots[k])]
        return all(lim >= k for lim, k in zip(rest, targets))

    best = min(sorted(pos[e.gid] for e in head)
               for head in itertools.combinations(occ, s.capacity) if legal(head))
    assert sorted(pos[e.gid] for e in out.buffers[0]) == best
