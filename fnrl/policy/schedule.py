"""When to generate, pull, train and evaluate: pure functions of a Snapshot.

Two schedules over one mechanism, so they compare like with like:

- `sync`: a global barrier. Generate one batch on the newest version, train on it,
  publish, pull everywhere, repeat. Every trajectory has staleness 0.
- `laminar`: trajectory-level asynchrony (Laminar, seed 000 §3). A rollout generates
  its own batch start to finish on one version and pulls the newest version from its
  relay only when that batch is done; the trainer consumes completed groups as soon as
  a step's worth is ready, without waiting for any rollout to finish.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from fnrl.types import Command, Evaluate, Generate, Group, Pull, Snapshot, Train


@dataclass(frozen=True, kw_only=True)
class SchedulePlan:
    mode: str
    total_steps: int
    groups_per_step: int
    groups_per_rollout_batch: int
    next_eval_version: int  # evaluate the first version served at or after this one
    # Laminar backpressure: how many completed groups may wait before rollouts pause.
    max_ready_groups: int


def decide(snap: Snapshot, plan: SchedulePlan) -> tuple[Command, ...]:
    """The commands to issue now. Never issues work to a busy rollout or trainer."""
    if plan.mode == "sync":
        return _decide_sync(snap, plan)
    if plan.mode == "laminar":
        return _decide_laminar(snap, plan)
    raise ValueError(f"unknown schedule mode {plan.mode!r}")


def _groups_still_needed(snap: Snapshot, plan: SchedulePlan) -> int:
    """Groups to start so that the remaining steps can be fed (nothing generated in vain)."""
    needed = (plan.total_steps - snap.steps_done) * plan.groups_per_step
    return max(0, needed - snap.ready_groups - snap.inflight_groups)


def _eval_due(plan: SchedulePlan, version: int) -> bool:
    return version >= plan.next_eval_version


def _decide_sync(snap: Snapshot, plan: SchedulePlan) -> tuple[Command, ...]:
    if snap.trainer_busy or any(r.busy for r in snap.rollouts):
        return ()
    if snap.ready_groups >= plan.groups_per_step and snap.steps_done < plan.total_steps:
        return (Train(plan.groups_per_step),)
    stale = tuple(Pull(r.rid) for r in snap.rollouts if r.version < snap.trainer_version)
    if stale:
        return stale
    if _eval_due(plan, snap.trainer_version):
        return (Evaluate(snap.rollouts[0].rid, snap.trainer_version),)
    todo = min(_groups_still_needed(snap, plan), plan.groups_per_step - snap.ready_groups)
    return _split(todo, [r.rid for r in snap.rollouts])


def _decide_laminar(snap: Snapshot, plan: SchedulePlan) -> tuple[Command, ...]:
    cmds: list[Command] = []
    if (not snap.trainer_busy and snap.ready_groups >= plan.groups_per_step
            and snap.steps_done < plan.total_steps):
        cmds.append(Train(plan.groups_per_step))
    todo = _groups_still_needed(snap, plan)
    evaluating = False
    for r in snap.rollouts:
        if r.busy:
            continue
        if r.version < snap.trainer_version:
            cmds.append(Pull(r.rid))
        elif not evaluating and _eval_due(plan, r.version):
            cmds.append(Evaluate(r.rid, r.version))
            evaluating = True
        elif todo > 0 and snap.ready_groups < plan.max_ready_groups:
            n = min(todo, plan.groups_per_rollout_batch)
            cmds.append(Generate(r.rid, n))
            todo -= n
    return tuple(cmds)


def _split(total: int, rids: Sequence[int]) -> tuple[Command, ...]:
    if total <= 0:
        return ()
    base, extra = divmod(total, len(rids))
    return tuple(Generate(rid, base + (i < extra)) for i, rid in enumerate(rids) if base + (i < extra))


def select_batch(ready: Sequence[Group], *, trainer_version: int, max_staleness: int,
                 num_groups: int) -> tuple[tuple[Group, ...], tuple[Group, ...], tuple[Group, ...]]:
    """FIFO batch of groups within the staleness bound: (batch, too_stale, remaining).

    A group older than `trainer_version - max_staleness` is dropped rather than
    trained on, so every consumed trajectory satisfies V_traj + η ≥ V_trainer.
    """
    fresh = [g for g in ready if g.version + max_staleness >= trainer_version]
    stale = tuple(g for g in ready if g.version + max_staleness < trainer_version)
    return tuple(fresh[:num_groups]), stale, tuple(fresh[num_groups:])
