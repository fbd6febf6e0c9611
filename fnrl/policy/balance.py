"""OrchestrRL's reactive balancer (seed 003 §4.2): move waiting, short-context requests
from the most to the least congested rollout while KV headroom allows.

The congestion score's formula (Eq. 5) is lost in the paper's text; its ingredients
and the three design considerations survive. We use the form the digest reconstructs,

    S_w = (|R_w| + |W_w|) / C_w · (L_w / L̄)

with C_w = min(M_w / (k5 · ℓ̄), max_num_seqs) the stable concurrency (the KV budget
over the mean context of the trajectories in flight, capped by the engine's batch limit,
as in OrchestrRL's §4.1 model) and 1/L_w the service rate, L_w being the
cost model's decode-step latency (StaleFlow App. B). Gap: the paper measures μ_w; we use
the cost model, so one model serves routing, migration, repack and balancing, and an idle
rollout still has a finite rate.
"""

from __future__ import annotations

import numpy as np

from fnrl.config import BalanceConfig
from fnrl.policy import cost_model
from fnrl.policy.routing import WorkingView
from fnrl.types import Migrate


def stable_concurrency(view: WorkingView) -> np.ndarray:
    """C_w per rollout: how many of the trajectories in flight its KV holds at once, at
    most its engine's sequence cap, at least one."""
    placed = view.inst >= 0
    mean_len = float(view.length[placed].mean()) if placed.any() else 1.0
    kv_bound = view.cap / (view.cost.k5 * max(mean_len, 1.0))
    return np.maximum(np.minimum(kv_bound, view.max_seqs), 1.0)


def congestion_scores(view: WorkingView, concurrency: np.ndarray | None = None) -> np.ndarray:
    concurrency = stable_concurrency(view) if concurrency is None else concurrency
    latency = cost_model.step_latency(view.cost, view.kv, view.n_run)
    return (view.n_run + view.n_wait) / concurrency * (latency / latency.mean())


def plan_balance(view: WorkingView, cfg: BalanceConfig) -> list:
    """Greedy moves (§4.2), applied to `view`; one Migrate per (src, dst) pair.

    Gap: the paper balances instances of one version (one-step asynchrony); here rollouts
    may serve different versions, and we move only between rollouts of the same version,
    so a trajectory never changes version by being balanced.
    """
    if view.R < 2 or cfg.max_moves == 0:
        return []
    concurrency = stable_concurrency(view)
    mean_latency = float(cost_model.step_latency(view.cost, view.kv, view.n_run).mean())
    score = congestion_scores(view, concurrency)
    moves: dict[tuple[int, int], list[int]] = {}
    for _ in range(cfg.max_moves):
        src = int(np.argmax(score))
        if view.n_wait[src] == 0:
            break  # only waiting requests move (waiting queue first, §4.2)
        peers = view.version == view.version[src]
        peers[src] = False
        if not peers.any():
            break
        dst = int(np.argmin(np.where(peers, score, np.inf)))
        if score[src] - score[dst] <= cfg.threshold:
            break
        idx = view.members(src)
        idx = idx[view.waiting[idx] & ~view.pinned[idx]]
        idx = idx[np.argsort(view.length[idx], kind="stable")]     # short context first
        # Feasibility: the request runs at once on dst (its KV fits, the batch is under
        # the sequence cap and nothing waits there), so admitting it does not cut dst's
        # stable concurrency.
        room = view.cap[dst] - view.kv[dst]
        open_ = view.n_wait[dst] == 0 and view.n_run[dst] < view.max_seqs[dst]
        fits = idx[view.cost.k5 * view.length[idx] <= room] if open_ else idx[:0]
        if fits.size == 0:
            break
        i = int(fits[0])
        view.place([i], dst)
        moves.setdefault((src, dst), []).append(i)
        for r in (src, dst):
            latency = cost_model.step_latency(view.cost, view.kv[r], view.n_run[r])
            score[r] = ((view.n_run[r] + view.n_wait[r]) / concurrency[r]
                        * (latency / mean_latency))
    return [Migrate(s, d, tuple(view.tid[idx].tolist())) for (s, d), idx in moves.items()]
