"""The run schedule: one pure `decide(snapshot, state, plan)` for every preset.

Every preset (fnrl.config.presets) is a configuration of one mechanism, StaleFlow's
snapshot → command cycle (fnrl.policy.cycle), so ablations compare like with like:

- `sync` is η = 0: a trajectory may only be admitted on the trainer's own version, so
  rollouts generate one batch, stop, the trainer consumes it, rollouts pull: a global
  barrier falls out of the bound.
- `one_step` is η = 1 with rollouts pulling only when they run dry.
- `partial_rollout` pulls on every new version, interrupting what runs and continuing
  it on the new weights from its streamed tokens (AReaL).
- `laminar` pulls when a rollout runs dry and repacks long tails (a loose η).
- `staleflow` is lazy sync, routing and migration under η.

Around the cycle this module decides what the cycle does not: to stop consuming once
the run's steps are issued, and when to evaluate held-out accuracy (on an idle rollout
that already serves the version due, so evaluation never forces a pull).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from fnrl.config import CoordinatorConfig
from fnrl.policy import staleness as st
from fnrl.policy.cycle import CycleConfig, CycleState, decide_cycle, init_cycle_state
from fnrl.policy.routing import SpeculativeState, snapshot_is_valid
from fnrl.types import ClusterSnapshot, Consume, Evaluate


def cycle_config(coord: CoordinatorConfig, *, batch_groups: int, prompt_groups: int) -> CycleConfig:
    """The coordinator's CycleConfig; buffers hold one training step's groups."""
    return CycleConfig(
        staleness=st.StalenessConfig(eta=coord.eta, batch_size=batch_groups,
                                     stuck_timeout_s=coord.stuck_timeout_s or None),
        routing=coord.routing, cost=coord.cost, sampler=coord.sampler,
        repack=coord.repack, balance=coord.balance,
        prompt_groups=prompt_groups)


NEVER = 1 << 40   # an eval_every no run reaches


@dataclass(frozen=True, kw_only=True)
class SchedulePlan:
    cycle: CycleConfig
    total_steps: int
    eval_every: int


def plan(coord: CoordinatorConfig, *, batch_groups: int, prompt_groups: int, total_steps: int,
         eval_every: int = NEVER) -> SchedulePlan:
    """The schedule of a run (the real loop's and the simulator's): the coordinator's
    cycle, the steps to train, and how often idle rollouts evaluate (never by default)."""
    return SchedulePlan(cycle=cycle_config(coord, batch_groups=batch_groups,
                                           prompt_groups=prompt_groups),
                        total_steps=total_steps, eval_every=eval_every)


@dataclass(frozen=True, eq=False)
class ScheduleState:
    cycle: CycleState
    consumed: int             # Consume commands issued so far (train steps started)
    next_eval_version: int    # evaluate the first version served at or after this one


def init_schedule(plan: SchedulePlan, inst_version_R, *, v_train: int,
                  steps_done: int) -> ScheduleState:
    return ScheduleState(cycle=init_cycle_state(plan.cycle, inst_version_R, v_train=v_train),
                         consumed=steps_done, next_eval_version=v_train + plan.eval_every)


def decide(snap: ClusterSnapshot, state: ScheduleState,
           plan: SchedulePlan) -> tuple[ScheduleState, tuple]:
    """Commands to act on now, in order, and the next state."""
    if state.consumed >= plan.total_steps:
        return state, ()  # every step is issued: let the last one finish
    evals, next_eval = _evaluation(snap, state.next_eval_version, plan.eval_every)
    cycle_state, cmds = decide_cycle(snap, state.cycle, plan.cycle)
    consumed = state.consumed + sum(isinstance(c, Consume) for c in cmds)
    return dataclasses.replace(state, cycle=cycle_state, consumed=consumed,
                               next_eval_version=next_eval), evals + cmds


def _evaluation(snap: ClusterSnapshot, next_eval: int, every: int) -> tuple[tuple, int]:
    """Evaluate a due version on a rollout with nothing placed on it. It goes first in
    the command list, and whatever is routed there or pulls there afterwards waits for
    it, so an evaluation never shares its rollout with generation or a weight change."""
    versions = np.asarray(snap.inst_version_R)
    placed = np.bincount(snap.traj_inst_N[snap.traj_inst_N >= 0], minlength=len(versions))
    due = np.flatnonzero((versions >= next_eval) & (placed == 0))
    if not due.size:
        return (), next_eval
    rid = int(due[np.argmax(versions[due])])
    return (Evaluate(rid, int(versions[rid])),), int(versions[rid]) + every


def finished(state: ScheduleState, plan: SchedulePlan, *, trainer_idle: bool) -> bool:
    """Every step has been issued and the last one has returned."""
    return state.consumed >= plan.total_steps and trainer_idle


def reconcile(state: ScheduleState, snap: ClusterSnapshot, *,
              pulls_in_flight: bool) -> tuple[ScheduleState, bool]:
    """Resets the speculative state P to what is observed when they disagree with no
    pull in flight (only a pull lands late; otherwise a pull got another version than
    P assumed). Returns the state and whether it was reset."""
    if pulls_in_flight or snapshot_is_valid(state.cycle.speculative, snap):
        return state, False
    cycle = dataclasses.replace(state.cycle, speculative=SpeculativeState.from_snapshot(snap))
    return dataclasses.replace(state, cycle=cycle), True

