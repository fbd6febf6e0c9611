"""StaleFlow's decode cost model (seed 001 §5.3, App. B): evaluate it, and fit it.

The model is `fnrl.config.CostModel`, L = k1·kv + max(k2, k3·n) + k4 per decode step
(Eq. 11). The functions below give the latency, the throughput T_i(S) (Eq. 2) and the
ideal and marginal gains of routing one trajectory (Eqs. 3, 4), numpy-broadcasting.

`fit_cost_model` fits it to measured runs (`python -m fnrl.experiments.profile_cost`
measures them). How a run becomes an equation: single decode steps cannot be timed
over HTTP, so each run (B streamed requests of prompt length P, released together,
each forced by `ignore_eos` to its own length) gives one equation for its wall time

    wall ≈ c0 + c_req·B + c_pre·B·P + Σ_t [k1·kv_t + k3·max(c, n_t) + k4]

where step t has n_t = #{i : len_i > t} running requests holding kv_t = Σ (P + t) tokens,
c = k2/k3 is the roofline point, c0 the per-batch and c_req the per-request HTTP and
scheduling overhead, c_pre the prefill cost per prompt token. Lengths differ within a
run so n_t falls during it, which separates the per-sequence term k3 from the per-step
term k4. For fixed c the model is linear; we scan c and keep the best fit. Rows are
weighted by 1/wall so short and long runs count alike (the error that matters to
routing is relative). Prefill and overheads are fitted but not part of the cost model,
which models decode only (App. B: decode is 89.9% of rollout time).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fnrl.config import CostModel


def step_latency(cost: CostModel, kv, n):
    """Seconds per decode step (Eq. 11)."""
    return cost.k1 * kv + np.maximum(cost.k2, cost.k3 * n) + cost.k4


def throughput(cost: CostModel, kv, n):
    """T_i(S) = |run| / L (Eq. 2): decoded tokens per second."""
    return n / step_latency(cost, kv, n)


def ideal_gain(cost: CostModel, length: float) -> float:
    """ΔT_ideal: routing to an idle instance (Eq. 4; Alg. 3 line 21's `k1×k2×len` is a
    typo for k1×k5×len, see the digest)."""
    return 1.0 / (cost.k1 * cost.k5 * length + max(cost.k2, cost.k3) + cost.k4)


def marginal_gain(cost: CostModel, kv, n, n_wait, capacity, t0, length: float):
    """ΔT_i of adding one trajectory of context `length` (Eq. 3). It runs only if its
    KV fits and nothing waits (y_i); otherwise it waits and adds nothing."""
    kv1 = kv + cost.k5 * length
    fits = (kv1 <= capacity) & (n_wait == 0)
    t1 = (n + 1) / (cost.k1 * kv1 + np.maximum(cost.k2, cost.k3 * (n + 1)) + cost.k4)
    return np.where(fits, t1 - t0, 0.0)


def roofline_batch(cost: CostModel) -> int:
    """Batch size where matmuls turn compute-bound, k2/k3 (App. B, Eqs. 9-10)."""
    return max(1, int(cost.k2 / cost.k3)) if cost.k3 > 0 else 1 << 30


# --- fitting (App. B: "offline profiling and linear regression") ------------------------

FEATURES = ("kv_tokens", "steps", "seq_steps", "batch", "requests", "prefill_tokens")
"""Columns of `step_features`; `seq_steps` is Σ max(c, n_t)."""


@dataclass(frozen=True)
class Measurement:
    prompt_len: int
    lengths: tuple[int, ...]     # generated tokens per request
    wall_s: float


def step_features(m: Measurement, crossover: float) -> np.ndarray:
    """[Σ kv_t, steps, Σ max(c, n_t), 1, B, B·P] for one run (order: FEATURES)."""
    lengths = np.asarray(m.lengths)
    t = np.arange(int(lengths.max()) if lengths.size else 0)
    running = lengths[None, :] > t[:, None]                  # T × B
    n_t = running.sum(1)
    kv_t = (running * (m.prompt_len + t[:, None])).sum(1)
    return np.array([kv_t.sum(), len(t), np.maximum(crossover, n_t).sum(), 1.0,
                     len(lengths), len(lengths) * m.prompt_len], dtype=np.float64)


@dataclass(frozen=True, kw_only=True)
class RunCostFit:
    """The decode cost model plus the per-run terms fitted beside it."""

    cost: CostModel
    overhead_s: float               # c0, per batch
    per_request_s: float            # c_req
    prefill_s_per_token: float      # c_pre

    @property
    def crossover(self) -> float:
        return self.cost.k2 / self.cost.k3 if self.cost.k3 > 0 else float("inf")

    def coefficients(self) -> np.ndarray:
        """Weights of `step_features(m, self.crossover)`."""
        return np.array([self.cost.k1, self.cost.k4, self.cost.k3, self.overhead_s,
                         self.per_request_s, self.prefill_s_per_token])

    def predict_wall(self, m: Measurement) -> float:
        c = self.crossover if np.isfinite(self.crossover) else 1.0
        return float(step_features(m, c) @ self.coefficients())


def fit_quality(fit: RunCostFit, runs: list[Measurement]) -> dict:
    """R² and relative errors of predicted against measured wall times."""
    y = np.array([m.wall_s for m in runs])
    pred = np.array([fit.predict_wall(m) for m in runs])
    rel = np.abs(pred - y) / y
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((pred - y) ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan")
    return {"runs": len(runs), "r2": r2, "mean_relative_error": float(rel.mean()),
            "median_relative_error": float(np.median(rel)),
            "max_relative_error": float(rel.max())}


def fit_cost_model(runs: list[Measurement], *, max_batch: int | None = None) -> RunCostFit:
    """Weighted least squares over (k1, k4, k3, c0, c_req, c_pre), scanning c = k2/k3."""
    if len(runs) < 2 * len(FEATURES):
        raise ValueError(f"need at least {2 * len(FEATURES)} runs to fit {len(FEATURES)} "
                         f"unknowns robustly, got {len(runs)}")
    y = np.array([m.wall_s for m in runs])
    if (y <= 0).any():
        raise ValueError("every run's wall_s must be > 0")
    w = 1.0 / y
    top = max_batch or max(len(m.lengths) for m in runs)
    best = None
    for c in np.unique(np.concatenate([np.linspace(1, top, 64), np.arange(1, top + 1)])):
        x = np.stack([step_features(m, c) for m in runs])
        coef = _nonnegative_lstsq(x * w[:, None], y * w)
        err = float((np.abs(x @ coef - y) * w).mean())
        # A decode step must cost something (k4, or k3 and k2 = c·k3): a fit that puts
        # (all but rounding of) every second elsewhere, on KV tokens, overhead, requests
        # or prefill, is not a model.
        stepped = float((x[:, 1:3] @ coef[1:3]).sum()) > 1e-6 * float(y.sum())
        if stepped and (best is None or err < best[2]):
            best = (c, coef, err)
    if best is None:
        raise ValueError(f"no fit of these {len(runs)} runs has a per-step decode cost (every "
                         "wall time went to KV tokens, overhead, requests or prefill): measure "
                         "longer responses, or more repeats of each batch")
    c, (k1, k4, k3, c0, c_req, c_pre), _ = best
    cost = CostModel(k1=float(k1), k2=float(k3 * c), k3=float(k3), k4=float(k4), k5=1.0)
    return RunCostFit(cost=cost, overhead_s=float(c0), per_request_s=float(c_req),
                      prefill_s_per_token=float(c_pre))


def stored_cost_model(data: dict, path) -> CostModel:
    """The CostModel of a cost file's JSON (`python -m fnrl.experiments.profile_cost`
    writes them; any JSON with k1..k5 is one); a profile whose fit was refused has its
    measurements but no model, and says why."""
    if data.get("fit_error"):
        raise ValueError(f"cost file {str(path)!r} holds measurements but no fit: "
                         f"{data['fit_error']}")
    try:
        return CostModel(**{k: float(data[k]) for k in ("k1", "k2", "k3", "k4", "k5")})
    except KeyError as err:
        raise ValueError(f"cost file {str(path)!r} lacks coefficient {err}") from None


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient ≥ 0 (latencies cannot be negative): refit
    without the columns that came out negative until none does (an active-set loop;
    exact here, where at most a few columns are ever dropped)."""
    active = np.ones(a.shape[1], bool)
    coef = np.zeros(a.shape[1])
    while active.any():
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        idx = np.flatnonzero(active)
        active[idx[np.argmin(sol)]] = False
    return coef
