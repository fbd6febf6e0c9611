"""Laminar's dynamic repack (seed 000 §5): Best-Fit consolidation of long-tail rollouts.

Within one weight-version group, rollouts in the KV ramp-down phase with few remaining
trajectories are packed onto as few of them as possible (Alg. 1); the released ones
pull the newest weights. A move interrupts the trajectories at the source and continues
them at the destination from their streamed tokens (re-prefill); both serve the same
version, so every trajectory stays single-version (Laminar §2.4).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fnrl.config import RepackConfig
from fnrl.policy import cost_model
from fnrl.policy.routing import WorkingView
from fnrl.types import Migrate, Pull


def best_fit_consolidation(c_used: np.ndarray, c_prev: np.ndarray, n_reqs: np.ndarray, *,
                           c_max: float, batch_bound: int,
                           step_s: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
                           max_slowdown: float = 0.0) -> list[tuple[int, int]]:
    """Alg. 1 on one version group: (source, destination) index pairs.

    With `step_s` (seconds per decode step as a function of KV utilization and batch),
    CanFit also requires the packed step to be at most (1 + max_slowdown) × the step of
    the source and of the destination before it (`RepackConfig.max_slowdown`).

    Guard (digest, "implementation notes"): as written, a rollout that already received
    sources could later leave as a source, and CanFit would then ignore what it took
    in; we never pick a destination as a source. Gap: Alg. 1 would also admit rollouts
    with no trajectories (nothing to release; moving onto them frees nothing), so they
    are left out. Candidates follow line 3 literally (strict C_used < C_prev).
    """
    c_used = np.asarray(c_used, np.float64)
    n_reqs = np.asarray(n_reqs, np.float64)
    cand = np.flatnonzero((c_used < np.minimum(c_max, c_prev)) & (n_reqs < batch_bound)
                          & (n_reqs > 0))
    cand = cand[np.argsort(c_used[cand], kind="stable")]              # line 4
    load_c, load_n = c_used[cand].copy(), n_reqs[cand].copy()         # C_load, N_load
    emptied = np.zeros(len(cand), bool)
    is_dest = np.zeros(len(cand), bool)
    plan = []
    for p in range(len(cand)):                                         # line 6
        if emptied[p] or is_dest[p]:
            continue
        fit = (~emptied & (load_c + load_c[p] <= c_max)                # CanFit, lines 14-17
               & (load_n + load_n[p] <= batch_bound))
        if step_s is not None:
            before = np.minimum(step_s(load_c, load_n), step_s(load_c[p], load_n[p]))
            fit &= step_s(load_c + load_c[p], load_n + load_n[p]) <= (1 + max_slowdown) * before
        fit[p] = False
        if not fit.any():
            continue
        q = int(np.argmax(np.where(fit, load_c, -np.inf)))            # line 11: best fit
        plan.append((int(cand[p]), int(cand[q])))
        emptied[p], is_dest[q] = True, True
        load_c[q] += load_c[p]
        load_n[q] += load_n[p]
    return plan


def repack_due(now_s: float, next_due_s: float, ps_version: int, seen_ps_version: int) -> bool:
    """§5.1: periodically, and right after the trainer publishes a version."""
    return now_s >= next_due_s or ps_version > seen_ps_version


def plan_repack(view: WorkingView, cfg: RepackConfig, ps_version: int) -> list:
    """Run Alg. 1 per weight-version group; Migrate commands, applied to `view`."""
    bound = cfg.batch_bound or cost_model.roofline_batch(view.cost)
    util = view.kv / np.maximum(view.cap, 1e-9)
    util_prev = view.kv_prev / np.maximum(view.cap, 1e-9)
    n_reqs = view.n_run + view.n_wait
    free = ~view.touched
    cmds = []
    for v in np.unique(view.version[free]).tolist():
        rids = np.flatnonzero(free & (view.version == v))
        # Utilization back to KV tokens at the group's smallest capacity (a version group's
        # rollouts are alike; the smallest errs towards not packing).
        cap = float(view.cap[rids].min())
        # B never above the engine's sequence cap: a pack beyond it would queue.
        seq_cap = float(view.max_seqs[rids].min())
        group_bound = bound if not np.isfinite(seq_cap) else min(bound, int(seq_cap))

        def step_s(c, n, cap=cap):
            return cost_model.step_latency(view.cost, c * cap, n)
        for s, d in best_fit_consolidation(util[rids], util_prev[rids], n_reqs[rids],
                                           c_max=cfg.c_max, batch_bound=group_bound,
                                           step_s=None if cfg.max_slowdown is None else step_s,
                                           max_slowdown=cfg.max_slowdown or 0.0):
            src, dst = int(rids[s]), int(rids[d])
            idx = view.members(src)
            if idx.size == 0 or view.pinned[idx].any():   # moved as often as a step allows
                continue
            cmds.append(Migrate(src, dst, tuple(view.tid[idx].tolist()), reason="repack"))
            # Laminar moves the KV footprint with the trajectories (CanFit adds C_used);
            # we re-prefill them, which rebuilds the same footprint at the destination.
            view.place(idx, dst)
            view.touched[src] = True
            if cfg.pull_released and view.version[src] < ps_version:
                cmds.append(Pull(src))
                view.pull(src, ps_version)
    return cmds
