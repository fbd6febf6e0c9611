"""StaleFlow's routing, sync, migration and snapshot validation (seed 001 §5)."""

import numpy as np
import pytest

from fnrl.config import CostModel, RoutingConfig
from fnrl.policy import staleness as st
from fnrl.policy.routing import (SpeculativeState, WorkingView, apply_commands, plan_migration,
                                 plan_sync, route, snapshot_is_valid)
import dataclasses

from fnrl.types import Abort, ClusterSnapshot, Interrupt, Migrate, Pull, Route


def snapshot(*, versions, kv=None, cap=100.0, trajs=(), ps_version=0, complete=None,
             max_seqs=None):
    """trajs: (tid, gid, inst, waiting, length) tuples."""
    R = len(versions)
    t = np.array(trajs, dtype=np.int64).reshape(-1, 5)
    return ClusterSnapshot(
        now_s=0.0, ps_version=ps_version, trainer_idle=False,
        inst_version_R=np.array(versions, np.int64),
        inst_kv_used_R=np.zeros(R) if kv is None else np.array(kv, float),
        inst_kv_prev_R=np.zeros(R), inst_kv_capacity_R=np.full(R, cap),
        inst_num_complete_R=np.zeros(R, np.int64) if complete is None else np.array(complete),
        traj_id_N=t[:, 0], traj_gid_N=t[:, 1], traj_inst_N=t[:, 2],
        traj_waiting_N=t[:, 3].astype(bool), traj_len_N=t[:, 4],
        inst_max_seqs_R=None if max_seqs is None else np.array(max_seqs))


@pytest.mark.parametrize("mu, expect", [(0.5, 1), (0.1, 0)])
def test_waterfall(mu, expect):
    """Hand-computed: k1=0.01, k2=1, k3=k4=0, length 10 → ΔT_ideal = 1/1.1 = 0.909.
    Rollout 0 (V0) runs 10 with kv 500: ΔT = 11/6.1 − 10/6 = 0.137. Rollout 1 (V1) is
    idle: ΔT = ΔT_ideal. μ = 0.5 falls through V0's group to V1; μ = 0.1 stays on V0."""
    cost = CostModel(k1=0.01, k2=1.0, k3=0.0, k4=0.0)
    trajs = [(100 + i, 50, 0, 0, 50) for i in range(10)] + [(7, 1, -1, 0, 10)]
    snap = snapshot(versions=[0, 1], kv=[500.0, 0.0], cap=1000.0, trajs=trajs, ps_version=1)
    s = st.init_staleness(st.StalenessConfig(eta=1, batch_size=4), v_train=1)
    s = st.reserve(s, 50, 0)
    view = WorkingView(snap, st.group_versions(s), cost)
    plan = route(view, s, st.empty_counts(s), mu)
    assert plan.routes == {expect: [10]}
    assert plan.admissions == [(1, expect)]


@pytest.mark.parametrize("mu", [1.0, 0.99])
@pytest.mark.parametrize("kv_residue", [0.0, 1e-12])
def test_mu_near_one_still_admits_to_an_idle_rollout(mu, kv_residue):
    """Issue 15: gains are taken at the length rounded up (100 → 2^(107/16) ≈ 103.4), so
    a threshold at the exact length sat above even an idle rollout's gain and μ ≥ 0.99
    routed nothing. μ = 1 means "only as good as an idle rollout": the idle one (with or
    without a float residue of KV from drained trajectories) takes it, the busy one not."""
    cost = CostModel(k1=0.01, k2=1.0, k3=0.0, k4=0.0)
    trajs = [(100 + i, 50, 0, 0, 50) for i in range(4)] + [(7, 1, -1, 0, 100)]
    snap = snapshot(versions=[0, 0], kv=[200.0, kv_residue], cap=1000.0, trajs=trajs)
    s = st.init_staleness(st.StalenessConfig(eta=1, batch_size=4))
    plan = route(WorkingView(snap, {}, cost), s, st.empty_counts(s), mu)
    assert plan.routes == {1: [4]}
    # Only a busy rollout: its gain is below ΔT_ideal, so μ = 1 withholds.
    busy = snapshot(versions=[0], kv=[200.0], cap=1000.0, trajs=trajs)
    assert route(WorkingView(busy, {}, cost), s, st.empty_counts(s), 1.0).routes == {}


def test_routing_stops_at_head_of_line():
    """A partial trajectory that fits nowhere withholds everything behind it (Alg. 3)."""
    cost = CostModel(k1=0.0, k2=1.0, k3=0.0, k4=0.0)
    trajs = [(1, 1, -1, 0, 500), (2, 2, -1, 0, 5)]      # 1: partial, V0, too long for KV
    snap = snapshot(versions=[0], cap=100.0, trajs=trajs)
    s = st.reserve(st.init_staleness(st.StalenessConfig(eta=1, batch_size=4)), 1, 0)
    plan = route(WorkingView(snap, st.group_versions(s), cost), s, st.empty_counts(s), 0.3)
    assert plan.routes == {} and plan.admissions == []


def test_admission_respects_the_buffers_within_one_cycle():
    """Probes see the cycle's own earlier reservations: batch 1, η 0 → one group only."""
    cost = CostModel(k1=0.0, k2=1.0, k3=0.0, k4=0.0)
    trajs = [(1, 1, -1, 0, 5), (2, 1, -1, 0, 5), (3, 2, -1, 0, 5)]
    snap = snapshot(versions=[0, 0], trajs=trajs)
    s = st.init_staleness(st.StalenessConfig(eta=0, batch_size=1))
    plan = route(WorkingView(snap, {}, cost), s, st.empty_counts(s), 0.3)
    assert plan.admissions == [(1, 0)]
    assert sorted(i for v in plan.routes.values() for i in v) == [0, 1]  # group 1 only


def test_lazy_sync_only_where_routing_needs_it():
    """η = 0, trainer at V1: V0 rollouts can admit nothing. The idle one is synced (work
    would be routed to it); the busy one keeps generating (its KV is not thrown away)
    when the idle one's upgrade suffices for the TS's one trajectory."""
    cost = CostModel(k1=0.0, k2=1.0, k3=0.0, k4=0.0)
    trajs = [(1, 9, 1, 0, 5), (2, 3, -1, 0, 5)]
    snap = snapshot(versions=[0, 0], kv=[0.0, 5.0], trajs=trajs, ps_version=1)
    s = st.init_staleness(st.StalenessConfig(eta=0, batch_size=4), v_train=1)
    view = WorkingView(snap, {9: 0}, cost)
    assert plan_sync(view, s, st.empty_counts(s), RoutingConfig(), 1) == [0]
    assert plan_sync(view, s, st.empty_counts(s), RoutingConfig(sync="greedy"), 1) == [0, 1]
    assert plan_sync(view, s, st.empty_counts(s), RoutingConfig(sync="on_idle"), 1) == [0]
    # Global sync waits for rollout 1 to run dry too, then pulls both at once.
    assert plan_sync(view, s, st.empty_counts(s), RoutingConfig(sync="global"), 1) == []
    drained = WorkingView(snapshot(versions=[0, 0], trajs=[(2, 3, -1, 0, 5)], ps_version=1),
                          {}, cost)
    assert plan_sync(drained, s, st.empty_counts(s), RoutingConfig(sync="global"), 1) == [0, 1]


def test_migration_cases():
    cost = CostModel(k1=0.0, k2=1.0, k3=0.0, k4=0.0)
    # Rollout 0: 3 waiting (lengths 5, 2, 9) → φ_wait = 1 sends the two shortest back.
    # Rollout 1 runs 12, rollout 2 runs 2: T = 12 vs 2 > φ_throughput = 5, but with no
    # KV or compute term every rollout gains the same from one more trajectory, so
    # routing would return all 12 to rollout 1 (the first best): Case 2 moves none.
    trajs = ([(1, 1, 0, 1, 5), (2, 1, 0, 1, 2), (3, 1, 0, 1, 9), (4, 1, 0, 0, 1)]
             + [(10 + i, 2, 1, 0, 3) for i in range(12)] + [(30, 3, 2, 0, 3), (31, 3, 2, 0, 3)])
    view = WorkingView(snapshot(versions=[0, 0, 0], trajs=trajs), {1: 0, 2: 0, 3: 0}, cost)
    s = st.init_staleness(st.StalenessConfig(eta=1, batch_size=4))
    cmds = plan_migration(view, RoutingConfig(phi_wait=1, phi_throughput=5.0), s,
                          st.empty_counts(s))
    assert cmds == [Interrupt(0, (2, 1))]
    assert view.n_wait[0] == 1 and view.n_run[1] == 12


def test_throughput_gap_moves_only_what_routing_places_elsewhere():
    """Compute-bound past 4 running (k3·n > k2): rollout 1's 12 short trajectories give
    T = 12/3 = 4, rollout 2's one long context T = 1/1.6, a gap above 5. Emptied,
    rollout 1 is the best place for its first trajectories again; only the ones routing
    would put on rollouts 0 and 2 leave, and routing does put every one of them there."""
    cost = CostModel(k1=0.01, k2=1.0, k3=0.25, k4=0.0, k5=1.0)
    trajs = [(10 + i, 2, 1, 0, 3) for i in range(12)] + [(30, 3, 2, 0, 60), (40, 4, 0, 0, 3)]
    snap = snapshot(versions=[0, 0, 0], kv=[3, 36, 60], trajs=trajs)
    view = WorkingView(snap, {2: 0, 3: 0, 4: 0}, cost)
    s = st.init_staleness(st.StalenessConfig(eta=1, batch_size=4))
    cmds = plan_migration(view, RoutingConfig(phi_throughput=5.0), s, st.empty_counts(s))
    assert len(cmds) == 1 and cmds[0].rid == 1
    moved = set(cmds[0].tids)
    assert 0 < len(moved) < 12
    assert view.n_run[1] == 12 - len(moved)
    plan = route(view, s, st.empty_counts(s), RoutingConfig().mu)
    dst = {int(view.tid[i]): r for r, idx in plan.routes.items() for i in idx}
    assert set(dst) == moved and 1 not in dst.values()


def test_speculative_state_validation():
    """Eq. 1 / Table 1: a snapshot that misses an issued Route is discarded."""
    snap = snapshot(versions=[0, 0], trajs=[(1, 1, -1, 0, 5)], complete=[0, 0])
    p = SpeculativeState.initial([0, 0])
    assert snapshot_is_valid(p, snap)
    p2 = apply_commands(p, [Route(1, (1,))], ps_version=0)
    assert not snapshot_is_valid(p2, snap)
    landed = snapshot(versions=[0, 0], trajs=[(1, 1, 1, 0, 5)], complete=[0, 0])
    assert snapshot_is_valid(p2, landed)
    p3 = apply_commands(p2, [Interrupt(1, (1,)), Pull(1)], ps_version=1)
    assert p3.version_R.tolist() == [0, 1] and p3.accum_R.tolist() == [0, 0]


def test_commands_that_cancel_in_the_counts_still_invalidate():
    """Eq. 1 alone passes a snapshot in which neither an Abort of trajectory 1 nor a
    Route of trajectory 2 onto the same rollout has landed (count 1 either way); the
    next cycle would route 2 a second time. P's expected placements reject it until
    both land, or the trajectories finish; a Migrate expects its destination."""
    before = snapshot(versions=[0, 0], trajs=[(1, 1, 0, 0, 5), (2, 2, -1, 0, 5)])
    p = apply_commands(SpeculativeState.initial([0, 0]), [Route(0, (1,))], ps_version=0)
    assert snapshot_is_valid(p, before)
    p = apply_commands(p, [Abort(0, (1,)), Route(0, (2,))], ps_version=0)
    assert p.accum_R.tolist() == [1, 0]
    assert not snapshot_is_valid(p, before)
    half = snapshot(versions=[0, 0], trajs=[(2, 2, 0, 0, 5), (1, 1, 0, 0, 5)])
    assert not snapshot_is_valid(dataclasses.replace(p, accum_R=np.array([2, 0])), half)
    assert snapshot_is_valid(p, snapshot(versions=[0, 0], trajs=[(2, 2, 0, 0, 5)]))
    assert snapshot_is_valid(p, snapshot(versions=[0, 0], trajs=[], complete=[1, 0]))
    p = apply_commands(p, [Migrate(0, 1, (2,))], ps_version=0)
    assert not snapshot_is_valid(dataclasses.replace(p, accum_R=np.array([1, 0])),
                                 snapshot(versions=[0, 0], trajs=[(2, 2, 0, 0, 5)]))
    assert snapshot_is_valid(p, snapshot(versions=[0, 0], trajs=[(2, 2, 1, 0, 5)]))


def test_a_rollout_at_its_sequence_cap_takes_nothing_more():
    """KV room for 100 tokens, no KV-read cost: the gain of one more trajectory of 10
    grows with the batch (k2 = 1 dominates), so all four go to rollout 0 (the lowest
    index). With an engine cap of 2 sequences there, rollout 0 takes two and rollout 1
    the other two; the loads say none of them waits. Migration's placement (`place`)
    and the balancer see the same cap."""
    cost = CostModel(k1=0.0, k2=1.0, k3=0.0, k4=0.0)
    trajs = [(i, i, -1, 0, 10) for i in range(4)]
    s = st.init_staleness(st.StalenessConfig(eta=0, batch_size=4))
    free = route(WorkingView(snapshot(versions=[0, 0], trajs=trajs), {}, cost), s,
                 st.empty_counts(s), 0.3)
    assert free.routes == {0: [0, 1, 2, 3]}
    capped = snapshot(versions=[0, 0], trajs=trajs, max_seqs=[2, 8])
    plan = route(WorkingView(capped, {}, cost), s, st.empty_counts(s), 0.3)
    assert plan.routes == {0: [0, 1], 1: [2, 3]}
    assert not any(w for ws in plan.waits.values() for w in ws)
    assert plan.load[1].tolist() == [2, 2] and plan.load[2].tolist() == [0, 0]
    view = WorkingView(capped, {}, cost)
    view.place([0, 1, 2], 0)
    assert view.waiting[[0, 1, 2]].tolist() == [False, False, True]


def test_config_validation():
    with pytest.raises(ValueError, match="mu=1.5"):
        RoutingConfig(mu=1.5)
    with pytest.raises(ValueError, match="sync='eager'"):
        RoutingConfig(sync="eager")
    with pytest.raises(ValueError, match="policy='least'"):
        RoutingConfig(policy="least")
    with pytest.raises(ValueError, match="k1=-1"):
        CostModel(k1=-1)


def test_fewest_routing_balances_counts_and_keeps_the_version_checks():
    """§6.5's vanilla routing (RoutingConfig.policy="fewest"). Rollouts 0-2 serve V0 with
    3, 2 (one waiting: its KV is full) and 2 trajectories; rollout 3 serves V1 with 5. The
    partial trajectory (V_traj = 1) can go only to rollout 3, however loaded. The new
    group's four then go to the fewest each time, ties to the first: counts 3,2,2 → r1;
    3,3,2 → r2; 3,3,3 → r0; 4,3,3 → r1. The waterfall never routes to r1 (nothing fits
    behind a waiting trajectory)."""
    cost = CostModel(k1=0.001, k2=1.0, k3=0.0, k4=0.0)
    trajs = ([(1, 1, 0, 0, 50), (2, 1, 0, 0, 50), (3, 1, 0, 0, 50), (4, 2, 1, 0, 50),
              (5, 2, 1, 1, 50), (6, 3, 2, 0, 50), (7, 3, 2, 0, 50)]
             + [(8 + i, 4, 3, 0, 50) for i in range(5)]
             + [(20, 5, -1, 0, 30)] + [(21 + i, 9, -1, 0, 10) for i in range(4)])
    snap = snapshot(versions=[0, 0, 0, 1], kv=[150.0, 100.0, 100.0, 250.0], cap=1000.0,
                    trajs=trajs, ps_version=1)
    s = st.init_staleness(st.StalenessConfig(eta=1, batch_size=4), v_train=1)
    versions = {1: 0, 2: 0, 3: 0, 4: 1, 5: 1}
    plan = route(WorkingView(snap, versions, cost), s, st.empty_counts(s), 0.3,
                 policy="fewest")
    assert plan.routes == {3: [12], 1: [13, 16], 2: [14], 0: [15]}
    assert [v for _, v in plan.admissions] == [0]
    assert plan.waits[1] == [True, True]          # queued behind rollout 1's waiting one
    waterfall = route(WorkingView(snap, versions, cost), s, st.empty_counts(s), 0.3)
    assert 1 not in waterfall.routes and waterfall.routes[3][0] == 12


def test_fewest_routing_passes_a_down_rollout_by():
    """A rollout that is down reports a KV capacity of 0 (the loop; the simulator's modes
    that are not up). The waterfall never routes there (nothing fits); the fewest
    routing, which never withholds for load, must not either, however empty it is: the
    four new trajectories go to rollouts 0 and 2 only, and with every rollout down none
    is routed."""
    cost = CostModel(k1=0.001, k2=1.0, k3=0.0, k4=0.0)
    trajs = [(1, 1, 0, 0, 50), (2, 2, 2, 0, 50)] + [(10 + i, 9, -1, 0, 10) for i in range(4)]
    snap = snapshot(versions=[0, 0, 0], kv=[50.0, 0.0, 50.0], cap=1000.0, trajs=trajs)
    snap = dataclasses.replace(snap, inst_kv_capacity_R=np.array([1000.0, 0.0, 1000.0]))
    s = st.init_staleness(st.StalenessConfig(eta=1, batch_size=4), v_train=0)
    plan = route(WorkingView(snap, {1: 0, 2: 0}, cost), s, st.empty_counts(s), 0.3,
                 policy="fewest")
    assert sorted(plan.routes) == [0, 2] and sum(map(len, plan.routes.values())) == 4
    down = dataclasses.replace(snap, inst_kv_capacity_R=np.zeros(3))
    assert route(WorkingView(down, {1: 0, 2: 0}, cost), s, st.empty_counts(s), 0.3,
                 policy="fewest").routes == {}
