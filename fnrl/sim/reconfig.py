"""OrchestrRL's switch of parallelism within a run, in the simulator (seed 003 §4.1,
§6.3; `ClusterSpec.rollout_modes`).

Every `replan_s` of virtual time the `Replanner` runs the paper's proactive planner,
the pure `fnrl.policy.orchestr.replan`: the forecast of the step's length distribution
from past steps, each unfinished request's remaining decode conditioned on its progress,
and the mode that finishes them soonest counting the switch. When that mode is not the
current one it returns a `Reconfigure`, which `Simulation.reconfigure` acts on: the old
mode's trajectories go back to the trajectory server with their tokens, no instance
generates for `switch_s`, and then the new mode's instances come up.

Gaps (ours): the forecast starts from `PRIOR_STEPS` past steps of the same workload drawn
with their own seed (the profiled history a job would have), then adds each trained
step's realized lengths; the re-plan period is not given (`ClusterSpec.replan_s`).
"""

from __future__ import annotations

import numpy as np

from fnrl.policy import orchestr
from fnrl.sim.config import SimConfig
from fnrl.sim.layout import Layout
from fnrl.sim.workload import WorkloadSpec, group_lengths
from fnrl.types import Reconfigure

PRIOR_STEPS, PRIOR_SEED = 4, 1_000_003   # the forecast's past steps, drawn apart
QUANTILES = 128       # fine enough that the forecast keeps the tail (top: the 99.6th)
HISTORY_STEPS = 8     # steps the forecast smooths over


def prior_history(spec: WorkloadSpec, steps: int = PRIOR_STEPS, seed: int = PRIOR_SEED,
                  quantiles: int = QUANTILES) -> list[np.ndarray]:
    """Length quantiles of `steps` past steps of the workload, drawn with their own seed."""
    g = spec.groups_per_step
    return [orchestr.step_quantiles(np.concatenate(
        [group_lengths(spec, seed, s * g + i, 0.0) for i in range(g)]), quantiles)
        for s in range(steps)]


class Replanner:
    """The planner's state in the simulated job: the length history and the next re-plan."""

    def __init__(self, problem: orchestr.ParallelismProblem, spec: WorkloadSpec,
                 replan_s: float):
        self.problem, self.spec, self.replan_s = problem, spec, replan_s
        self.history = prior_history(spec)
        self.next_s = 0.0

    def record(self, lengths) -> None:
        """A trained step's realized response lengths join the forecast's history."""
        self.history = [*self.history, orchestr.step_quantiles(lengths, QUANTILES)][-HISTORY_STEPS:]

    def __call__(self, now: float, current_tp: int, generated_N, context_N) -> Reconfigure | None:
        """A re-plan if one is due and there is work left; a `Reconfigure` if it switches."""
        if now < self.next_s or len(generated_N) == 0:
            return None
        self.next_s = now + self.replan_s
        plan = orchestr.replan(self.problem, self.history, generated_N, context_N,
                               current_tp=current_tp, len_max=self.spec.len_max,
                               requests_per_step=self.spec.groups_per_step * self.spec.group_size)
        return Reconfigure(plan.tp) if plan.tp != current_tp else None


def replanner_for(cfg: SimConfig, lay: Layout) -> Replanner | None:
    """The run's planner over its layout's modes, or None for a fixed deployment."""
    c = cfg.cluster
    if not c.rollout_modes:
        return None
    modes = tuple(orchestr.Mode(tp=m.tp, cost=m.decode.cost, kv_capacity=m.kv_capacity,
                                max_num_seqs=c.max_num_seqs) for m in lay.modes)
    start = lay.modes[0]
    problem = orchestr.ParallelismProblem(gpus=len(start.rids) * start.tp, modes=modes,
                                          gpus_per_node=c.gpus_per_machine, switch_s=c.switch_s)
    return Replanner(problem, cfg.workload, c.replan_s)
