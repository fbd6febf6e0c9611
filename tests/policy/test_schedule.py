"""The run schedule around the coordinator cycle: sync as η = 0, evaluation placement,
the end of a run."""

import numpy as np

from fnrl.config import CoordinatorConfig, RoutingConfig
from fnrl.policy import schedule
from fnrl.policy.schedule import decide, finished, init_schedule
from fnrl.types import ClusterSnapshot, Consume, Evaluate, FillPrompts, Pull, Route


def plan(eta=0, total_steps=10, eval_every=100, sync="greedy"):
    coord = CoordinatorConfig(eta=eta, routing=RoutingConfig(sync=sync, migrate=False, mu=0.0))
    return schedule.plan(coord, batch_groups=2, prompt_groups=2, total_steps=total_steps,
                         eval_every=eval_every)


def snap(versions, *, ps=0, idle=True, tids=(), gids=(), inst=(), rewarded=(), complete=None):
    R = len(versions)
    n = len(tids)
    return ClusterSnapshot(
        now_s=0.0, ps_version=ps, trainer_idle=idle,
        inst_version_R=np.array(versions, np.int64), inst_kv_used_R=np.zeros(R),
        inst_kv_prev_R=np.zeros(R), inst_kv_capacity_R=np.full(R, 1e6),
        inst_num_complete_R=np.array(complete or [0] * R, np.int64),
        traj_id_N=np.array(tids, np.int64), traj_gid_N=np.array(gids, np.int64),
        traj_inst_N=np.array(inst, np.int64).reshape(-1), traj_waiting_N=np.zeros(n, bool),
        traj_len_N=np.full(n, 4, np.int64), rewarded_gids=tuple(rewarded))


def test_first_cycle_fills_prompts_then_routes_them():
    p = plan()
    state = init_schedule(p, [0, 0], v_train=0, steps_done=0)
    state, cmds = decide(snap([0, 0]), state, p)
    assert cmds == (FillPrompts(2),)
    # Two groups of two trajectories each are in the TS now.
    state, cmds = decide(snap([0, 0], tids=[0, 1, 2, 3], gids=[0, 0, 1, 1], inst=[-1] * 4),
                         state, p)
    routed = sorted(t for c in cmds if isinstance(c, Route) for t in c.tids)
    assert routed == [0, 1, 2, 3]


def test_sync_is_a_barrier_and_pulls_before_the_next_batch():
    p = plan(eta=0)
    state = init_schedule(p, [0], v_train=0, steps_done=0)
    state, _ = decide(snap([0]), state, p)
    s = snap([0], tids=[0, 1, 2, 3], gids=[0, 0, 1, 1], inst=[-1] * 4)
    state, cmds = decide(s, state, p)
    assert sum(len(c.tids) for c in cmds if isinstance(c, Route)) == 4
    # Both groups finished and rewarded: consume them; new prompts are not admitted on
    # version 0 any more (η = 0), so nothing is routed while the trainer trains.
    state, cmds = decide(snap([0], rewarded=[0, 1], complete=[4], tids=[4, 5], gids=[2, 2],
                              inst=[-1, -1]), state, p)
    assert Consume(0, (0, 1)) in cmds and not any(isinstance(c, Route) for c in cmds)
    # The trainer published version 1: the rollout pulls, then the new batch is routed.
    state, cmds = decide(snap([0], ps=1, complete=[4], tids=[4, 5], gids=[2, 2], inst=[-1, -1]),
                         state, p)
    kinds = [type(c) for c in cmds]
    assert Pull in kinds and kinds.index(Pull) < kinds.index(Route)


def test_evaluation_only_on_an_idle_rollout_and_first_in_the_command_list():
    p = plan(eta=1, eval_every=2, sync="on_idle")
    state = init_schedule(p, [2, 2], v_train=2, steps_done=2)
    assert state.next_eval_version == 4
    busy = snap([4, 4], ps=4, tids=[0, 1], gids=[0, 0], inst=[0, 1])
    state2, cmds = decide(busy, state, p)
    assert not any(isinstance(c, Evaluate) for c in cmds)
    one_idle = snap([4, 4], ps=4, tids=[0], gids=[0], inst=[0])
    state2, cmds = decide(one_idle, state, p)
    assert cmds[0] == Evaluate(1, 4) and state2.next_eval_version == 6


def test_nothing_after_the_last_step_is_issued():
    p = plan(total_steps=3)
    state = init_schedule(p, [0], v_train=3, steps_done=3)
    assert decide(snap([3], ps=3), state, p) == (state, ())
    assert finished(state, p, trainer_idle=True)
    assert not finished(state, p, trainer_idle=False)


def test_speculative_state_is_reset_only_when_no_pull_can_explain_the_difference():
    from fnrl.policy.schedule import reconcile

    p = plan()
    state = init_schedule(p, [0, 0], v_train=0, steps_done=0)
    observed = snap([0, 1])                       # rollout 1 serves a version P did not plan
    same, reset = reconcile(state, observed, pulls_in_flight=True)
    assert same is state and not reset            # a pull may still land: wait
    fixed, reset = reconcile(state, observed, pulls_in_flight=False)
    assert reset and fixed.cycle.speculative.version_R.tolist() == [0, 1]
    again, reset = reconcile(fixed, observed, pulls_in_flight=False)
    assert again is fixed and not reset


def test_a_skipped_step_moves_the_buffers_down_and_training_goes_on():
    import dataclasses

    p = plan(eta=1, total_steps=10)
    state = init_schedule(p, [0], v_train=3, steps_done=3)
    assert state.cycle.staleness.v_train == 3
    state, _ = decide(dataclasses.replace(snap([3], ps=3, idle=False), skipped_steps=1), state, p)
    assert state.cycle.staleness.v_train == 2
