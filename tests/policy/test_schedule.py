from fnrl.data.arith import Problem
from fnrl.policy.schedule import SchedulePlan, decide, select_batch
from fnrl.types import (Evaluate, Generate, Group, Pull, RolloutView, Segment, Snapshot, Train,
                        Trajectory)


def plan(mode, **kw):
    base = dict(mode=mode, total_steps=10, groups_per_step=4, groups_per_rollout_batch=4,
                next_eval_version=100, max_ready_groups=8)
    return SchedulePlan(**{**base, **kw})


def snap(rollouts, *, trainer_version=0, trainer_busy=False, ready=0, inflight=0, steps=0):
    return Snapshot(rollouts=tuple(RolloutView(i, v, b) for i, (v, b) in enumerate(rollouts)),
                    trainer_version=trainer_version, trainer_busy=trainer_busy,
                    ready_groups=ready, inflight_groups=inflight, steps_done=steps)


def test_sync_generates_one_batch_split_over_rollouts():
    assert decide(snap([(0, False), (0, False)]), plan("sync")) == (Generate(0, 2), Generate(1, 2))


def test_sync_barrier_waits_for_every_rollout():
    assert decide(snap([(0, True), (0, False)], ready=2, inflight=2), plan("sync")) == ()


def test_sync_trains_then_pulls_everywhere():
    assert decide(snap([(0, False), (0, False)], ready=4), plan("sync")) == (Train(4),)
    assert decide(snap([(0, False), (0, False)], trainer_version=1, steps=1), plan("sync")) == (
        Pull(0), Pull(1))


def test_laminar_trains_while_rollouts_generate_and_pulls_only_idle_ones():
    cmds = decide(snap([(0, True), (0, False)], trainer_version=1, ready=4, inflight=4, steps=1),
                  plan("laminar"))
    assert cmds == (Train(4), Pull(1))


def test_laminar_idle_rollout_on_newest_version_generates():
    cmds = decide(snap([(1, False)], trainer_version=1, trainer_busy=True, steps=1),
                  plan("laminar"))
    assert cmds == (Generate(0, 4),)


def test_no_generation_beyond_what_remaining_steps_need():
    cmds = decide(snap([(9, False)], trainer_version=9, trainer_busy=True, inflight=4, steps=9),
                  plan("laminar"))
    assert cmds == ()


def test_evaluation_when_due():
    cmds = decide(snap([(0, False), (0, False)]), plan("laminar", next_eval_version=0))
    assert cmds[0] == Evaluate(0, 0) and cmds[1] == Generate(1, 4)


def _group(version, uid="p"):
    t = Trajectory(uid=uid, prompt_ids=(1,), segments=(Segment(version, (3,), (-0.1,)),),
                   finish_reason="stop", reward=1.0)
    return Group(Problem(uid, "1+1=", "2", 1), (t,))


def test_select_batch_enforces_staleness_bound_fifo():
    ready = [_group(0, "a"), _group(3, "b"), _group(4, "c"), _group(5, "d")]
    batch, stale, rest = select_batch(ready, trainer_version=5, max_staleness=2, num_groups=2)
    assert [g.problem.uid for g in batch] == ["b", "c"]
    assert [g.problem.uid for g in stale] == ["a"]
    assert [g.problem.uid for g in rest] == ["d"]
    assert all(g.version + 2 >= 5 for g in batch)
