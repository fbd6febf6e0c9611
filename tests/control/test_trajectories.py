"""The controller's trajectory table and the long-tailed workload, without processes."""

import numpy as np
import pytest

from fnrl.config import RolloutConfig
from fnrl.control.trajectories import IN_TS, TrajectoryTable
from fnrl.control.workload import forced_length
from fnrl.types import Problem


def table_with_two_groups():
    table = TrajectoryTable()
    for i in range(2):
        table.add_group(Problem(f"p{i}", "1+1=", "2", 1), (2, 5, 13), [None, None])
    return table


def snapshot(table, waiting=(0, 0)):
    return table.snapshot(now_s=1.0, ps_version=3, trainer_idle=True, inst_version_R=[3, 2],
                          inst_kv_prev_R=[0, 0], inst_kv_capacity_R=[100, 100],
                          inst_num_complete_R=[1, 0], waiting_counts=list(waiting))


def test_ids_in_arrival_order_with_group_members_together():
    table = table_with_two_groups()
    snap = snapshot(table)
    assert snap.traj_id_N.tolist() == [0, 1, 2, 3]
    assert snap.traj_gid_N.tolist() == [0, 0, 1, 1]
    assert (snap.traj_inst_N == IN_TS).all()
    assert table.trajs[3].uid == "p1/1"


def test_kv_counts_context_of_placed_running_trajectories_only():
    table = table_with_two_groups()
    t0, t1, t2, t3 = (table.trajs[i] for i in range(4))
    t0.inst, t0.tokens, t0.started = 0, 4, True       # context 3 + 4
    t1.inst = 0                                          # placed, no token yet
    t2.inst = 1
    t3.finished = True                                   # finished: not in the snapshot
    snap = snapshot(table, waiting=(1, 0))
    assert snap.traj_id_N.tolist() == [0, 1, 2]
    # vLLM reports one waiting request on rollout 0: the newest without a token (t1).
    assert snap.traj_waiting_N.tolist() == [False, True, False]
    assert snap.inst_kv_used_R.tolist() == [7.0, 3.0]
    assert snap.traj_len_N.tolist() == [7, 3, 3]


def test_reward_and_drop_events_are_read_once_and_snapshots_change_nothing():
    table = table_with_two_groups()
    table.rewarded.append(1)
    table.dropped.append(0)
    snapshot(table)
    assert table.rewarded == [1] and table.dropped == [0]    # a snapshot drains nothing
    assert table.take_events() == ((1,), (0,))
    assert table.take_events() == ((), ())


def test_a_rewarded_group_is_consumed_once():
    from fnrl.types import Group

    table = table_with_two_groups()
    group = Group(table.groups[1].problem, ())
    table.reward(1, group, keep=True)
    table.reward(0, Group(table.groups[0].problem, ()), keep=False)
    assert table.take_events() == ((1,), (0,))
    assert table.consume([1]) == (group,)
    with pytest.raises(KeyError, match="p1"):
        table.consume([1])
    with pytest.raises(KeyError, match="p0"):
        table.consume([0])                                    # dropped: never trained


def test_forced_lengths_are_reproducible_and_heavy_tailed():
    cfg = RolloutConfig(response_len="lognormal", len_median=16, len_sigma=1.0, len_max=96)
    lens = np.array([forced_length(cfg, 0, tid) for tid in range(4000)])
    assert lens.tolist()[:50] == [forced_length(cfg, 0, tid) for tid in range(50)]
    assert 14 <= np.median(lens) <= 18
    assert lens.max() == 96 and lens.min() >= 1
    assert lens.mean() > 1.3 * np.median(lens)          # the tail pulls the mean up
    pareto = RolloutConfig(response_len="pareto", len_median=16, len_sigma=1.5, len_max=96)
    p = np.array([forced_length(pareto, 0, tid) for tid in range(4000)])
    assert 14 <= np.median(p) <= 18 and p.max() == 96
    assert forced_length(RolloutConfig(), 0, 7) is None
