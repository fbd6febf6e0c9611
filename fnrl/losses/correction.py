"""Train/inference mismatch: corrections and the telemetry that measures it.

vLLM's kernels (and quantisation, and staleness) make μ, the behaviour log-prob it
reports, differ from the trainer's π_old for the same weights and tokens. The
corrections reweight or drop tokens by w = π_old/μ, per token or per sequence:

  token_tis    w_t ← min(w_t, cap)                              truncated IS
  seq_tis      w   ← min(Π_t w_t, cap), one weight per sequence
  token_mask   drop tokens with w_t outside [low, high]
  seq_mask     drop sequences whose geometric-mean w is outside [low, high]

Every step also reports the mismatch itself (see `mismatch_metrics`).
"""

from __future__ import annotations

import jax.numpy as jnp

from fnrl.losses.core import Batch, Metrics, sequence_mean, sequence_sum, token_mean

CORRECTIONS = ("none", "token_tis", "seq_tis", "token_mask", "seq_mask")


def correct(old_logp_BxT: jnp.ndarray, batch: Batch, *, kind: str, tis_cap: float,
            mask_low: float, mask_high: float) -> tuple[dict, Metrics]:
    """Batch with `old_logp_BxT`, `is_weight_BxT` and a narrowed mask; plus metrics.

    `old_logp_BxT` must be constant (stop-gradient): the weights are not trained.
    """
    if kind not in CORRECTIONS:
        raise ValueError(f"unknown correction {kind!r}; known: {CORRECTIONS}")
    out = dict(batch)
    if kind == "none":
        return out, {}
    mask = batch["mask_BxT"]
    log_w = (old_logp_BxT - batch["behaviour_logp_BxT"]) * mask
    weight = jnp.ones_like(mask)
    keep = jnp.ones_like(mask)
    if kind == "token_tis":
        weight = jnp.minimum(jnp.exp(log_w), tis_cap)
    elif kind == "seq_tis":
        # Clamp the log before exp: a product over hundreds of tokens overflows.
        weight = jnp.exp(jnp.minimum(sequence_sum(log_w, batch), jnp.log(tis_cap)))
    elif kind == "token_mask":
        w = jnp.exp(log_w)
        keep = ((w >= mask_low) & (w <= mask_high)).astype(mask.dtype)
    else:
        w = jnp.exp(sequence_mean(log_w, batch))
        keep = ((w >= mask_low) & (w <= mask_high)).astype(mask.dtype)
    out.update(old_logp_BxT=old_logp_BxT, is_weight_BxT=weight, mask_BxT=mask * keep)
    if "weight_BxT" in batch:
        # Every term sums with the aggregation weights (fnrl.losses.core.aggregate), set
        # from the whole batch before this: a rejected token must lose its weight too, or
        # it keeps its full gradient in every term. Its slot is not handed to the others.
        out["weight_BxT"] = batch["weight_BxT"] * keep
    metrics = {"is_weight_mean": token_mean(weight, mask),
               "masked_frac": token_mean(1.0 - keep, mask)}
    return out, metrics


def mismatch_metrics(logp_BxT: jnp.ndarray, batch: Batch) -> Metrics:
    """How far the trainer's log-probs π are from the behaviour log-probs μ.

    logp_abs_diff: mean |log π - log μ|; mismatch/kl_k1 and mismatch/kl_k3 estimate
    KL(μ‖π) from μ's samples (k3 = r - 1 - log r, r = π/μ); mismatch/is_* are
    quantiles of r over response tokens.
    """
    mask = batch["mask_BxT"]
    log_r = logp_BxT - batch["behaviour_logp_BxT"]
    r = jnp.exp(log_r)
    r_masked = jnp.where(mask > 0, r, jnp.nan)
    q = jnp.nanquantile(r_masked.reshape(-1), jnp.array([0.01, 0.5, 0.99]))
    any_token = jnp.sum(mask) > 0
    q = jnp.where(any_token, q, 1.0)
    return {
        "logp_abs_diff": token_mean(jnp.abs(log_r), mask),
        "mismatch/kl_k1": token_mean(-log_r, mask),
        "mismatch/kl_k3": token_mean(r - 1.0 - log_r, mask),
        "mismatch/is_p01": q[0], "mismatch/is_p50": q[1], "mismatch/is_p99": q[2],
        "mismatch/is_max": jnp.where(any_token, jnp.max(jnp.where(mask > 0, r, -jnp.inf)), 1.0),
        "mismatch/is_min": jnp.where(any_token, jnp.min(jnp.where(mask > 0, r, jnp.inf)), 1.0),
    }
