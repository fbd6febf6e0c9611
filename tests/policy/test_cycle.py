"""The decision cycle over random schedules, against a fake rollout service.

Properties (checked by FakeCluster on every command and after every event):
- every consumed trajectory has V_traj + η ≥ V_buf on every token; with η = 0 every
  token comes from V_buf itself (the schedule is synchronous);
- no group is consumed twice; an admitted group is always tracked, consumed or dropped;
- commands are executable: Route takes from the TS, Interrupt / Migrate / Abort find the
  trajectory where they say, Pull only hits an empty rollout;
- after the random part, the job keeps training (no deadlock).
"""

import numpy as np
from hypothesis import example, given, settings, strategies as hst

from fnrl.config import BalanceConfig, CostModel, RepackConfig, RoutingConfig
from fnrl.policy import staleness as st
from fnrl.policy.cycle import CycleConfig, decide_cycle, decide_cycle_traced, init_cycle_state
from fnrl.types import Consume, FillPrompts, Interrupt, Migrate, Pull, Route

from tests.policy.fake_cluster import FakeCluster

# Memory-bound-ish engine in token units, so routing takes a few trajectories per rollout.
COST = CostModel(k1=1e-3, k2=1e-2, k3=1e-3, k4=1e-2)

events = hst.lists(hst.one_of(
    hst.tuples(hst.just("cycle"), hst.booleans()),
    hst.tuples(hst.just("land"), hst.just(0)),
    hst.tuples(hst.just("decode"), hst.integers(0, 3)),
    hst.tuples(hst.just("train"), hst.just(0)),
    hst.tuples(hst.just("drop"), hst.integers(0, 30)),
), max_size=120)


def run_schedule(cfg, R, G, evs, seed):
    fc = FakeCluster(cfg, num_rollouts=R, group_size=G, kv_capacity=20.0, seed=seed)
    for kind, x in evs:
        if kind == "cycle":
            fc.cycle(lag=x)
        elif kind == "land":
            fc.land()
        elif kind == "decode":
            fc.decode(x % R)
        elif kind == "train":
            fc.finish_training()
        elif kind == "drop" and x % 5 == 0:
            fc.drop(x // 5)
        fc.check()
    # Drain: everything lands, rollouts decode, the trainer trains. It must progress.
    fc.land()
    start = fc.ps_version
    for _ in range(300):
        fc.cycle()
        fc.check()
        for r in range(R):
            fc.decode(r)
        fc.finish_training()
        if fc.ps_version >= start + 2:
            break
    assert fc.ps_version >= start + 2, "no progress: the schedule deadlocked"
    return fc


configs = hst.builds(
    lambda eta, batch, sync, migrate, repack, balance, timeout, sampler: CycleConfig(
        staleness=st.StalenessConfig(eta=eta, batch_size=batch, stuck_timeout_s=timeout),
        routing=RoutingConfig(sync=sync, migrate=migrate, phi_wait=1), cost=COST,
        sampler=sampler,
        repack=RepackConfig(batch_bound=6, period_s=0.5) if repack else None,
        balance=BalanceConfig(threshold=0.1) if balance else None),
    eta=hst.integers(0, 2), batch=hst.integers(1, 3),
    sync=hst.sampled_from(["lazy", "greedy", "on_idle", "global"]), migrate=hst.booleans(),
    repack=hst.booleans(), balance=hst.booleans(),
    timeout=hst.sampled_from([None, None, 2.0]),
    sampler=hst.sampled_from(["fifo", "oldest_version"]))


@settings(max_examples=60, deadline=None)
@given(cfg=configs, R=hst.integers(1, 3), G=hst.integers(1, 3), evs=events,
       seed=hst.integers(0, 2**16))
# Found by this test: an Abort and a Route that cancel in Eq. 1's counts, neither landed,
# passed validation, and the next cycle routed the same trajectory again.
@example(cfg=CycleConfig(staleness=st.StalenessConfig(eta=0, batch_size=1), cost=COST,
                         routing=RoutingConfig(sync="lazy", migrate=False, phi_wait=1)),
         R=1, G=1, evs=[("cycle", False), ("cycle", False), ("drop", 0), ("cycle", True),
                        ("cycle", False)], seed=0)
def test_random_schedules_keep_the_bound_and_lose_nothing(cfg, R, G, evs, seed):
    run_schedule(cfg, R, G, evs, seed)


@settings(max_examples=25, deadline=None)
@given(R=hst.integers(1, 3), G=hst.integers(1, 3), evs=events, seed=hst.integers(0, 2**16))
def test_eta_zero_is_synchronous(R, G, evs, seed):
    """η = 0: every token of every trained trajectory comes from the version trained
    (FakeCluster asserts it on each Consume), and at least two steps are consumed."""
    cfg = CycleConfig(staleness=st.StalenessConfig(eta=0, batch_size=2), cost=COST)
    fc = run_schedule(cfg, R, G, evs, seed)
    assert len(set(fc.consumed.values())) >= 2


def test_invalid_snapshot_issues_no_rollout_commands():
    cfg = CycleConfig(staleness=st.StalenessConfig(eta=1, batch_size=2), cost=COST)
    fc = FakeCluster(cfg, num_rollouts=2, group_size=2)
    fc.cycle()                      # fills prompts
    cmds = fc.cycle(lag=True)       # routes, but the Routes do not land
    assert any(isinstance(c, Route) for c in cmds)
    state, cmds, report = decide_cycle_traced(fc.snapshot(), fc.state, cfg)
    assert not report.valid
    assert not any(isinstance(c, (Route, Interrupt, Pull)) for c in cmds)
    fc.land()
    _, _, report = decide_cycle_traced(fc.snapshot(), fc.state, cfg)
    assert report.valid


def test_sync_interrupt_keeps_reservations():
    """Partial rollout (StaleFlow §4.3): interrupting a rollout to pull a new version
    leaves every existing entry in its buffer; the interrupted trajectories keep V_traj
    and resume on the upgraded rollout (version ≥ V_traj)."""
    cfg = CycleConfig(staleness=st.StalenessConfig(eta=2, batch_size=1), cost=COST,
                      routing=RoutingConfig(sync="greedy"))
    fc = FakeCluster(cfg, num_rollouts=1, group_size=2, seed=3)
    for _ in range(200):                   # run until a version lands mid-generation
        fc.cycle()
        fc.decode(0)
        fc.finish_training()
        running = [t for t in fc.trajs.values() if isinstance(t.where, tuple)]
        if fc.ps_version > fc.version[0] and running:
            break
    assert fc.ps_version > fc.version[0] and running
    before = {e.gid: (k, e) for k, buf in enumerate(fc.state.staleness.buffers) for e in buf}
    v_before = fc.state.staleness.v_train
    cmds = fc.cycle()
    kinds = [type(c) for c in cmds]
    assert kinds[:2] == [Interrupt, Pull] and Route in kinds
    after = {e.gid: (k, e) for k, buf in enumerate(fc.state.staleness.buffers) for e in buf}
    assert fc.state.staleness.v_train == v_before
    for gid, where in before.items():
        assert after[gid] == where
    resumed = set(cmds[0].tids) & {t for c in cmds if isinstance(c, Route) for t in c.tids}
    assert resumed                          # interrupted and routed again, same cycle
    fc.check()


def test_consume_and_fill():
    cfg = CycleConfig(staleness=st.StalenessConfig(eta=0, batch_size=1), cost=COST)
    state = init_cycle_state(cfg, [0])
    fc = FakeCluster(cfg, num_rollouts=1, group_size=1)
    fc.state = state
    cmds = fc.cycle()
    assert cmds == (FillPrompts(1),)
    fc.cycle()
    while not fc.rewarded:
        fc.decode(0)
    cmds = fc.cycle()
    assert isinstance(cmds[0], Consume) and cmds[0] == Consume(0, (0,))


def test_decide_cycle_is_pure():
    """Same snapshot and state in, same commands and state out; inputs untouched."""
    cfg = CycleConfig(staleness=st.StalenessConfig(eta=1, batch_size=2), cost=COST,
                      repack=RepackConfig(), balance=BalanceConfig())
    fc = FakeCluster(cfg, num_rollouts=3, group_size=2)
    for _ in range(5):
        fc.cycle()
        fc.decode(0)
    snap = fc.snapshot()
    copies = {k: v.copy() for k, v in snap.__dict__.items() if isinstance(v, np.ndarray)}
    s1, c1 = decide_cycle(snap, fc.state, cfg)
    s2, c2 = decide_cycle(snap, fc.state, cfg)
    assert c1 == c2 and s1.staleness == s2.staleness
    for k, v in copies.items():
        np.testing.assert_array_equal(getattr(snap, k), v)


@settings(max_examples=60, deadline=None)
@given(R=hst.integers(2, 4), G=hst.integers(1, 3), evs=events, seed=hst.integers(0, 2**16),
       phi=hst.sampled_from([1.5, 5.0]))
def test_migration_never_moves_a_trajectory_back_or_twice_without_progress(R, G, evs, seed,
                                                                           phi):
    """Migration (Alg. 5) moves a trajectory only to place it better:
    - within a cycle, routing never returns an interrupted trajectory to the rollout it
      just left (a net-zero move);
    - a cycle applied to its predecessor's result (nothing decoded in between) moves
      none of the trajectories that one moved;
    - while every rollout decodes between cycles, no trajectory is migrated again before
      it has produced a token since its last move (the Case 2 livelock).
    Sync's interrupts (followed by a Pull of the same rollout) bring trajectories back by
    design and are not migrations."""
    cfg = CycleConfig(staleness=st.StalenessConfig(eta=1, batch_size=2), cost=COST,
                      routing=RoutingConfig(phi_wait=1, phi_throughput=phi))
    fc = FakeCluster(cfg, num_rollouts=R, group_size=G, kv_capacity=20.0, seed=seed)
    tail = [("cycle", "tail")] + [("decode", r) for r in range(R)]
    moved_at: dict[int, int] = {}     # tid -> its length when last migrated (tail only)
    just_moved: set[int] = set()      # migrated since the last decode
    for kind, x in [(k, x) for k, x in evs if k != "land"] + tail * 30:
        if kind == "cycle":
            before = {t.tid: t.length for t in fc.trajs.values()}
            cmds = fc.cycle()
            pulled = {c.rid for c in cmds if isinstance(c, Pull)}
            routed = {(tid, c.rid) for c in cmds if isinstance(c, Route) for tid in c.tids}
            for c in cmds:
                if not isinstance(c, Interrupt) or c.rid in pulled:
                    continue
                for tid in c.tids:
                    assert (tid, c.rid) not in routed, ("moved back", tid, c.rid)
                    assert tid not in just_moved, ("moved again at once", tid)
                    just_moved.add(tid)
                    if x == "tail":
                        assert moved_at.get(tid) != before[tid], ("no progress", tid)
                        moved_at[tid] = before[tid]
        elif kind == "decode":
            fc.decode(x % R)
            just_moved.clear()
        elif kind == "train":
            fc.finish_training()
        fc.check()


@settings(max_examples=80, deadline=None)
@given(R=hst.integers(2, 4), G=hst.integers(2, 4), evs=events, seed=hst.integers(0, 2**16),
       policy=hst.sampled_from(["waterfall", "fewest"]), kv=hst.sampled_from([6.0, 12.0]),
       extras=hst.sampled_from(["none", "repack", "balance"]))
def test_under_kv_pressure_work_never_goes_back_and_moves_are_bounded_per_step(
        R, G, evs, seed, policy, kv, extras):
    """Every rule that moves work (migration's two cases, repack, balancing), on KV so
    small that waiting queues form on every rollout, with either routing policy:
    - no trajectory a migration interrupts is routed back, in the same cycle, to the
      rollout it left (the thrash: with "fewest" routing, Case 1 sent every overflowing
      trajectory straight back, every cycle);
    - no trajectory is moved more than `moves_per_step` times while the trainer is at
      one version, however many cycles pass (here up to 30 with nothing trained)."""
    limit = 2
    cfg = CycleConfig(staleness=st.StalenessConfig(eta=1, batch_size=2), cost=COST,
                      routing=RoutingConfig(phi_wait=0, policy=policy, moves_per_step=limit),
                      repack=RepackConfig(batch_bound=6, period_s=0.5) if extras == "repack"
                      else None,
                      balance=BalanceConfig(threshold=0.0) if extras == "balance" else None)
    fc = FakeCluster(cfg, num_rollouts=R, group_size=G, kv_capacity=kv, seed=seed)
    moves: dict[tuple[int, int], int] = {}
    tail = [("cycle", 0)] + [("decode", r) for r in range(R)]
    for kind, x in [(k, x) for k, x in evs if k not in ("land", "train")] + tail * 30:
        if kind == "cycle":
            cmds = fc.cycle()
            version = fc.state.staleness.v_train
            pulled = {c.rid for c in cmds if isinstance(c, Pull)}
            routed = {(tid, c.rid) for c in cmds if isinstance(c, Route) for tid in c.tids}
            for c in cmds:
                if isinstance(c, Interrupt) and c.rid not in pulled:
                    moved = [(tid, c.rid) for tid in c.tids]
                elif isinstance(c, Migrate):
                    moved = [(tid, c.src) for tid in c.tids]
                else:
                    continue
                for tid, left in moved:
                    assert (tid, left) not in routed, ("moved back", tid, left)
                    moves[tid, version] = moves.get((tid, version), 0) + 1
                    assert moves[tid, version] <= limit, ("moved too often", tid, version)
        elif kind == "decode":
            fc.decode(x % R)
        fc.check()
