"""OrchestrRL's reactive balancer (seed 003 §4.2)."""

import numpy as np
import pytest

from fnrl.config import BalanceConfig, CostModel
from fnrl.policy.balance import congestion_scores, plan_balance
from fnrl.policy.routing import WorkingView
from fnrl.types import ClusterSnapshot, Migrate


def snap(versions, kv, cap, trajs, max_seqs=None):
    R, t = len(versions), np.array(trajs, np.int64).reshape(-1, 4)  # tid, inst, waiting, len
    return ClusterSnapshot(
        now_s=0.0, ps_version=0, trainer_idle=False, inst_version_R=np.array(versions),
        inst_kv_used_R=np.array(kv, float), inst_kv_prev_R=np.zeros(R),
        inst_kv_capacity_R=np.array(cap, float), inst_num_complete_R=np.zeros(R, np.int64),
        traj_id_N=t[:, 0], traj_gid_N=t[:, 0], traj_inst_N=t[:, 1],
        traj_waiting_N=t[:, 2].astype(bool), traj_len_N=t[:, 3],
        inst_max_seqs_R=None if max_seqs is None else np.array(max_seqs))


def test_moves_short_waiting_requests_to_the_least_congested():
    """Rollout 0: KV full, 3 waiting (lengths 40, 10, 25). Rollout 1: idle, 50 free.
    Rollout 2 is idle too but serves another version. Moves: shortest first (10, then 25,
    which fit in 50); 40 no longer fits, so balancing stops."""
    trajs = [(1, 0, 0, 90), (2, 0, 1, 40), (3, 0, 1, 10), (4, 0, 1, 25)]
    view = WorkingView(snap([0, 0, 1], [90, 0, 0], [100, 50, 100], trajs), {},
                       CostModel(k1=0.0, k2=1.0, k3=0.0, k4=0.0))
    scores = congestion_scores(view)
    assert scores[0] > scores[1] == scores[2] == 0
    cmds = plan_balance(view, BalanceConfig(threshold=0.0))
    assert cmds == [Migrate(0, 1, (3, 4))]
    assert view.n_wait.tolist() == [1, 0, 0] and view.n_run.tolist() == [1, 2, 0]


def test_the_sequence_cap_bounds_moves_and_concurrency():
    """The same cluster with rollouts 0 and 1 capped at one sequence: only the shortest
    moves (rollout 1's KV would hold 25 too), and C_w is min(KV bound, cap): rollout 0's
    KV bound is 100 / mean length 41.25 = 2.42, over its cap of 1."""
    trajs = [(1, 0, 0, 90), (2, 0, 1, 40), (3, 0, 1, 10), (4, 0, 1, 25)]
    free = congestion_scores(WorkingView(snap([0, 0, 1], [90, 0, 0], [100, 50, 100], trajs),
                                         {}, CostModel(k1=0.0, k2=1.0, k3=0.0, k4=0.0)))
    view = WorkingView(snap([0, 0, 1], [90, 0, 0], [100, 50, 100], trajs, max_seqs=[1, 1, 8]),
                       {}, CostModel(k1=0.0, k2=1.0, k3=0.0, k4=0.0))
    assert congestion_scores(view)[0] == pytest.approx(free[0] * (100 / 41.25))
    assert plan_balance(view, BalanceConfig(threshold=0.0)) == [Migrate(0, 1, (3,))]


def test_balanced_cluster_is_left_alone():
    trajs = [(1, 0, 0, 10), (2, 0, 1, 10), (3, 1, 0, 10), (4, 1, 1, 10)]
    view = WorkingView(snap([0, 0], [10, 10], [10, 10], trajs), {}, CostModel())
    assert plan_balance(view, BalanceConfig(threshold=0.1)) == []


def test_config_validation():
    with pytest.raises(ValueError, match="max_moves=-1"):
        BalanceConfig(max_moves=-1)
