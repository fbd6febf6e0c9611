"""OrchestrRL's proactive planner (seed 003 §4.1), as pure functions: the forecast of
what is left to decode, and the parallelism plan under a GPU budget. The reactive
balancer (§4.2) is `fnrl.policy.balance`.

Remaining-length forecast. The planner predicts no single request's length. It keeps
a forecast of the step-level length distribution, drops the requests that finished,
and conditions on each unfinished request's progress:

    forecast_quantiles   ARIMA(0,1,1) on each quantile of the past steps' lengths
    step_distribution    the forecast as one sorted length per request of the step
    remove_completed     drop the point nearest each realized length
    remaining_lengths    E[L − g | L > g] over the points left, g = tokens generated
    remaining_work       the same as a multiset: the conditional quantiles, for the plan
    bucketize            256-token buckets, each at its maximum (the paper's proxy)
    replan               the periodic re-plan: all of the above into plan_parallelism

Parallelism plan. `plan_parallelism` picks, among the candidate modes (TP degree d,
one instance per d GPUs, d within a node), the one whose instances finish the
remaining work soonest, counting the switch cost when it differs from the current
mode; `instance_makespan` is the performance model F_m of the MILP's constraint (1).

Gaps the paper leaves, filled here (the digest's §0: the MILP and Eq. 5 are stripped):
  - ARIMA's order is not given: ARIMA(0,1,1), whose forecast is exponential smoothing
    of the level, on each quantile; the smoothing weight is a parameter.
  - A request past every forecast point: its remaining length is half of what is left
    to the length limit (the forecast says nothing about it but that it is long).
  - F_m, not given: the fluid model of `instance_makespan` over the decode cost model
    L = k1·kv + max(k2, k3·n) + k4 (StaleFlow App. B, `fnrl.config.CostModel`).
  - The MILP (per-instance modes, per-bucket assignment) is solved by enumeration over
    homogeneous deployments (every instance one mode, as the paper's case study: 8×TP2
    or 2×TP8), with buckets dealt longest first round-robin, which balances the
    instances' remaining tokens the way the reactive balancer keeps them. Mixed modes
    are not searched.
  - Constraint (3) (KV near a target utilisation) becomes the concurrency limit of
    F_m: an instance runs at most as many requests as its KV holds at their mean
    context.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fnrl.config import CostModel

BUCKET_TOKENS = 256     # §4.1 heuristic 1


# --- remaining-length forecast ---------------------------------------------------------------


def forecast_quantiles(history_SxQ, *, smoothing: float = 0.5) -> np.ndarray:
    """Next step's length quantiles from the past S steps' (oldest first): ARIMA(0,1,1)
    per quantile, i.e. the level f ← f + smoothing·(y − f), kept non-decreasing."""
    h = np.asarray(history_SxQ, np.float64)
    if h.ndim != 2 or h.shape[0] < 1 or h.shape[1] < 1:
        raise ValueError(f"history_SxQ has shape {h.shape}: need (steps >= 1, quantiles >= 1)")
    if not 0.0 < smoothing <= 1.0:
        raise ValueError(f"smoothing={smoothing!r}: must be in (0, 1]")
    level = h[0].copy()
    for y in h[1:]:
        level += smoothing * (y - level)
    return np.maximum.accumulate(np.maximum(level, 1.0))


def step_quantiles(lengths, num_quantiles: int = 20) -> np.ndarray:
    """One step's observed lengths as `num_quantiles` mid-point quantiles (a history row)."""
    q = (np.arange(num_quantiles) + 0.5) / num_quantiles
    return np.quantile(np.asarray(lengths, np.float64), q)


def step_distribution(quantiles_Q, num_requests: int) -> np.ndarray:
    """The forecast as one length per request of the step: the quantile function
    (linear between the mid-point quantiles) at the requests' mid-point ranks."""
    quantiles_Q = np.asarray(quantiles_Q, np.float64)
    Q = len(quantiles_Q)
    ranks = (np.arange(num_requests) + 0.5) / num_requests
    return np.interp(ranks, (np.arange(Q) + 0.5) / Q, quantiles_Q)


def remove_completed(points_N, realized) -> np.ndarray:
    """The distribution of the requests still running: each realized length removes the
    nearest point left, so the points describe only the remaining requests (§4.1)."""
    points = np.sort(np.asarray(points_N, np.float64))
    keep = np.ones(len(points), bool)
    for x in np.asarray(realized, np.float64).ravel():
        left = np.flatnonzero(keep)
        if left.size == 0:
            break
        keep[left[np.argmin(np.abs(points[left] - x))]] = False
    return points[keep]


def remaining_lengths(generated_N, points, *, len_max: int) -> np.ndarray:
    """Each unfinished request's expected remaining decode: E[L − g | L > g] over the
    forecast points left, g its tokens so far; past every point, (len_max − g) / 2."""
    g = np.asarray(generated_N, np.float64)
    p = np.sort(np.asarray(points, np.float64))
    # Σ p over points above g, by suffix sums of the sorted points.
    above = len(p) - np.searchsorted(p, g, side="right")
    suffix = np.concatenate([np.cumsum(p[::-1])[::-1], [0.0]])
    total = suffix[len(p) - above]
    tail = np.maximum(len_max - g, 1.0) / 2.0
    mean_above = np.divide(total, above, out=np.zeros_like(g), where=above > 0)
    rem = np.where(above > 0, mean_above - g, tail)
    return np.clip(rem, 1.0, np.maximum(len_max - g, 1.0))


def remaining_work(generated_N, points, *, len_max: int,
                   width: int = BUCKET_TOKENS) -> np.ndarray:
    """The remaining decode of the unfinished requests as a multiset, for the plan:
    requests with progress in the same `width`-token bucket are exchangeable, so the m
    of them take the m mid-rank quantiles of {p − g : p > g}, the forecast points above
    their progress g (a fresh step's requests take the forecast itself). Without such
    points, `remaining_lengths`' fallback. Same order as `generated_N`."""
    g = np.asarray(generated_N, np.float64)
    p = np.sort(np.asarray(points, np.float64))
    out = remaining_lengths(g, p, len_max=len_max)
    key = np.floor(g / width)
    for k in np.unique(key):
        idx = np.flatnonzero(key == k)
        g0 = float(g[idx].min())
        above = p[p > g[idx].max()] - g0
        if above.size == 0:
            continue
        ranks = (np.arange(idx.size) + 0.5) / idx.size
        q = np.interp(ranks, (np.arange(above.size) + 0.5) / above.size, above)
        # Longer-running requests are the likelier to be long: the largest quantiles go
        # to the most progressed, less what each has done beyond the group's least.
        order = idx[np.argsort(g[idx], kind="stable")]
        out[order] = q - (g[order] - g0)
    return np.clip(out, 1.0, np.maximum(len_max - g, 1.0))


def bucketize(remaining_N, *, width: int = BUCKET_TOKENS) -> tuple[np.ndarray, np.ndarray]:
    """(representative lengths, counts) of the `width`-token buckets in use; a bucket
    stands for its maximum, the paper's conservative proxy (§4.1)."""
    r = np.asarray(remaining_N, np.float64)
    top = np.maximum(np.ceil(r / width), 1).astype(np.int64) * width
    reps, counts = np.unique(top, return_counts=True)
    return reps, counts


# --- parallelism plan ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mode:
    """One candidate parallel mode: an instance of `tp` GPUs, its decode cost and KV."""

    tp: int
    cost: CostModel
    kv_capacity: float                 # KV tokens one instance holds
    max_num_seqs: int = 1024

    def __post_init__(self):
        for name in ("tp", "kv_capacity", "max_num_seqs"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Mode.{name}={getattr(self, name)!r}: must be > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelismProblem:
    gpus: int                          # G: the generation cluster (constraint 2)
    modes: tuple[Mode, ...]
    gpus_per_node: int = 8             # TP stays within a node (§4.1 heuristic 2)
    switch_s: float = 14.0             # one reconfiguration (§6.3: ~14 s, 8×TP2 → 2×TP8)

    def __post_init__(self):
        if self.gpus < 1:
            raise ValueError(f"ParallelismProblem.gpus={self.gpus!r}: must be >= 1")
        if not self.modes:
            raise ValueError("ParallelismProblem.modes=(): need at least one candidate")
        if self.switch_s < 0:
            raise ValueError(f"ParallelismProblem.switch_s={self.switch_s!r}: must be >= 0")


@dataclasses.dataclass(frozen=True)
class ParallelismPlan:
    tp: int                            # the chosen mode's degree
    instances: int                     # G // tp
    makespan_s: float                  # F over the remaining work, switch excluded
    switch: bool                       # differs from the current mode
    total_s: float                     # makespan + the switch cost if any (the objective)
    candidates: tuple[tuple[int, float], ...]   # (tp, makespan) of every feasible mode


def instance_makespan(mode: Mode, remaining_K, context_K) -> float:
    """F_m: seconds for one instance to finish requests with `remaining_K` tokens to
    decode and `context_K` tokens held now. With the requests sorted longest first,
    j run while the j-th longest is unfinished; each such segment takes its steps at
    L(kv at its mid-point, min(j, C)), stretched j/C times when more than the
    concurrency C = min(max_num_seqs, capacity / mean context) wait their turn."""
    r = np.asarray(remaining_K, np.float64)
    if r.size == 0:
        return 0.0
    order = np.argsort(-r, kind="stable")
    r, ctx = r[order], np.asarray(context_K, np.float64)[order]
    final = ctx + r
    conc = max(1.0, min(float(mode.max_num_seqs), mode.kv_capacity / max(final.mean(), 1.0)))
    j = np.arange(1, r.size + 1, dtype=np.float64)
    nxt = np.append(r[1:], 0.0)
    steps = r - nxt                                   # steps with exactly j running
    mid = (r + nxt - 1.0) / 2.0                       # steps taken, mean over the segment
    kv = np.cumsum(ctx) + j * mid
    c = mode.cost
    n = np.minimum(j, conc)
    kv = kv * n / j                                   # only the running ones hold KV
    step = c.k1 * c.k5 * kv + np.maximum(c.k2, c.k3 * n) + c.k4
    return float(np.sum(steps * step * np.maximum(j / conc, 1.0)))


def deployment_makespan(mode: Mode, instances: int, remaining_N, context_N) -> float:
    """The makespan of `instances` instances of `mode`: requests dealt longest first,
    round-robin, and the slowest instance's F_m."""
    r = np.asarray(remaining_N, np.float64)
    ctx = np.asarray(context_N, np.float64)
    order = np.argsort(-r, kind="stable")
    return max((instance_makespan(mode, r[order[i::instances]], ctx[order[i::instances]])
                for i in range(min(instances, max(r.size, 1)))), default=0.0)


def plan_parallelism(problem: ParallelismProblem, remaining_N, context_N, *,
                     current_tp: int | None = None) -> ParallelismPlan:
    """The mode minimising makespan + switch cost (the MILP's objective) for the requests
    left, given each one's remaining decode (`remaining_lengths`, by bucket maximum) and
    context. Modes whose degree exceeds a node, the budget, or whose instance cannot hold
    the longest request are not candidates."""
    reps = np.asarray(remaining_N, np.float64)
    reps = np.maximum(np.ceil(reps / BUCKET_TOKENS), 1) * BUCKET_TOKENS
    ctx = np.asarray(context_N, np.float64)
    longest = float((ctx + reps).max()) if reps.size else 0.0
    candidates, best = [], None
    for mode in problem.modes:
        if mode.tp > problem.gpus_per_node or mode.tp > problem.gpus or mode.kv_capacity < longest:
            continue
        count = problem.gpus // mode.tp
        span = deployment_makespan(mode, count, reps, ctx)
        switch = current_tp is not None and mode.tp != current_tp
        total = span + (problem.switch_s if switch else 0.0)
        candidates.append((mode.tp, span))
        if best is None or total < best.total_s:
            best = ParallelismPlan(mode.tp, count, span, switch, total, ())
    if best is None:
        raise ValueError(f"no candidate mode fits {problem.gpus} GPUs ({problem.gpus_per_node} "
                         f"a node) and a request of {longest:.0f} tokens: modes "
                         f"{[(m.tp, m.kv_capacity) for m in problem.modes]}")
    return dataclasses.replace(best, candidates=tuple(candidates))


def replan(problem: ParallelismProblem, history_SxQ, generated_N, context_N, *,
           current_tp: int | None, len_max: int, requests_per_step: int,
           smoothing: float = 0.5) -> ParallelismPlan:
    """The planner's periodic run (§4.1): the forecast of the step's length distribution
    from past steps' quantiles, each unfinished request's remaining decode conditioned
    on its progress (`generated_N`; a queued one at 0 takes the forecast itself), and
    the mode that finishes them soonest counting the switch from `current_tp` (None: a
    fresh deployment, no switch charged).

    Gap (ours): the paper re-plans "periodically" from the remaining requests of the
    step; with one step in flight at a time (its one-step pipeline) every unfinished
    request is the step's, so no request is told apart by step here."""
    points = step_distribution(forecast_quantiles(history_SxQ, smoothing=smoothing),
                               requests_per_step)
    remaining = remaining_work(generated_N, points, len_max=len_max)
    return plan_parallelism(problem, remaining, context_N, current_tp=current_tp)
