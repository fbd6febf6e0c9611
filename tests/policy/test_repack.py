"""Laminar's Best-Fit consolidation (seed 000 §5, Alg. 1)."""

import dataclasses

import numpy as np
import pytest

from fnrl.config import CostModel, RepackConfig
from fnrl.policy.repack import best_fit_consolidation, plan_repack, repack_due
from fnrl.policy.routing import WorkingView
from fnrl.types import ClusterSnapshot, Migrate, Pull


def test_algorithm1_by_hand():
    """C_max 0.99, B 8. Candidates (line 3): r0, r1, r2, r5 (r3's KV is rising, r4 has
    N = B). Sorted by C_used: r0 .10, r5 .20, r1 .30, r2 .50.
      r0 → fits r5 (.30), r1 (.40), r2 (.60): best fit is the fullest, r2 (now .60, N 4).
      r5 → fits r1 (.50, N 7), r2 (.80, N 8): r2 again (now .80, N 8).
      r1 → r2 would reach 1.10 > C_max: no destination; r1 stays.
      r2 is a destination: the guard keeps it from leaving as a source, which Alg. 1 as
      printed would allow (onto r1, ignoring the load r2 just took in)."""
    c_used = np.array([0.10, 0.30, 0.50, 0.60, 0.45, 0.20])
    c_prev = np.array([0.20, 0.40, 0.60, 0.50, 0.70, 0.25])
    n_reqs = np.array([2, 3, 2, 1, 8, 4])
    assert best_fit_consolidation(c_used, c_prev, n_reqs, c_max=0.99, batch_bound=8) == \
        [(0, 2), (5, 2)]


def test_a_pack_that_slows_the_kv_bound_step_is_refused():
    """step(c, n) = 10·c + max(1, 0.01·n): the KV-read term dominates. r0 (.05, step 1.5)
    onto r1 (.10, step 2.0) gives .15, step 2.5: 1.67× r0's step. Refused at a 10% bound,
    admitted at 100% (2.5 ≤ 2 × 1.5) and by the paper's rule alone (no step model)."""
    c_used, c_prev, n_reqs = np.array([0.05, 0.10]), np.array([0.5, 0.5]), np.array([2, 3])

    def step(c, n):
        return 10 * c + np.maximum(1.0, 0.01 * n)

    kw = dict(c_max=0.99, batch_bound=8)
    assert best_fit_consolidation(c_used, c_prev, n_reqs, **kw, step_s=step,
                                  max_slowdown=0.1) == []
    assert best_fit_consolidation(c_used, c_prev, n_reqs, **kw, step_s=step,
                                  max_slowdown=1.0) == [(0, 1)]
    assert best_fit_consolidation(c_used, c_prev, n_reqs, **kw) == [(0, 1)]
    # Weight-bound (no KV term): packing is free below B, as the roofline rule assumes.
    assert best_fit_consolidation(c_used, c_prev, n_reqs, **kw,
                                  step_s=lambda c, n: np.maximum(1.0, 0.01 * n) + 0 * c,
                                  max_slowdown=0.0) == [(0, 1)]


def test_triggers():
    assert repack_due(5.0, 5.0, 3, 3)        # the period elapsed
    assert repack_due(1.0, 5.0, 4, 3)        # a new version was published
    assert not repack_due(1.0, 5.0, 3, 3)


def test_plan_repack_moves_within_a_version_group_and_releases():
    """Rollouts 0, 1 (V0) are in ramp-down: 0's trajectories move onto 1, and 0 pulls V1.
    Rollout 2 (V1) is alone in its group: nothing to pack it with."""
    R = 3
    snap = ClusterSnapshot(
        now_s=0.0, ps_version=1, trainer_idle=False,
        inst_version_R=np.array([0, 0, 1]), inst_kv_used_R=np.array([10.0, 30.0, 10.0]),
        inst_kv_prev_R=np.array([20.0, 40.0, 20.0]), inst_kv_capacity_R=np.full(R, 100.0),
        inst_num_complete_R=np.zeros(R, np.int64),
        traj_id_N=np.array([1, 2, 3, 4]), traj_gid_N=np.array([1, 1, 2, 3]),
        traj_inst_N=np.array([0, 0, 1, 2]), traj_waiting_N=np.zeros(4, bool),
        traj_len_N=np.array([5, 5, 30, 10]))
    view = WorkingView(snap, {1: 0, 2: 0, 3: 1}, CostModel())
    cmds = plan_repack(view, RepackConfig(batch_bound=8), ps_version=1)
    assert cmds == [Migrate(0, 1, (1, 2), reason="repack"), Pull(0)]
    assert view.kv.tolist() == [0.0, 40.0, 10.0] and view.version.tolist() == [1, 0, 1]
    # With a KV-read term that makes 40 tokens' step 2.4× 10 tokens', the pack is refused
    # at a 10% bound, and taken by the paper's rule alone (the default).
    kv_bound = CostModel(k1=1e-3, k2=1e-3, k3=1e-6, k4=1e-2)
    assert plan_repack(WorkingView(snap, {1: 0, 2: 0, 3: 1}, kv_bound), RepackConfig(
        batch_bound=8, max_slowdown=0.1), ps_version=1) == []
    view = WorkingView(snap, {1: 0, 2: 0, 3: 1}, kv_bound)
    cmds = plan_repack(view, RepackConfig(batch_bound=8), ps_version=1)
    assert cmds == [Migrate(0, 1, (1, 2), reason="repack"), Pull(0)]
    assert view.kv.tolist() == [0.0, 40.0, 10.0] and view.version.tolist() == [1, 0, 1]
    # B is at most the engine's sequence cap: 3 trajectories do not pack under a cap of 2.
    capped = dataclasses.replace(snap, inst_max_seqs_R=np.array([8, 2, 8]))
    assert plan_repack(WorkingView(capped, {1: 0, 2: 0, 3: 1}, CostModel()),
                       RepackConfig(batch_bound=8), ps_version=1) == []
    capped = dataclasses.replace(snap, inst_max_seqs_R=np.array([8, 3, 8]))
    assert plan_repack(WorkingView(capped, {1: 0, 2: 0, 3: 1}, CostModel()),
                       RepackConfig(batch_bound=8), ps_version=1) == [Migrate(0, 1, (1, 2), reason="repack"),
                                                                      Pull(0)]


def test_config_validation():
    with pytest.raises(ValueError, match="c_max=0"):
        RepackConfig(c_max=0)
    with pytest.raises(ValueError, match="max_slowdown"):
        RepackConfig(max_slowdown=-0.1)
