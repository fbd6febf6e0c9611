"""Policy-gradient loss terms: PPO clip, AIPO, AReaL's decoupled PPO, GSPO.

All take μ (`behaviour_logp_BxT`) from the batch: the log-probs vLLM actually
sampled with, shipped with every token. When the trainer applies a train/inference
mismatch correction it also sets `old_logp_BxT` (π_old) and `is_weight_BxT`; PPO
and GSPO then clip around π_old and multiply by the correction weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fnrl.losses.core import (LOSS_TERMS, Batch, Metrics, advantages_BxT, aggregate, register,
                              sequence_mean, token_mean)

_sg = jax.lax.stop_gradient


def _anchor(batch: Batch) -> jnp.ndarray:
    """The clip anchor: π_old when a correction supplies it, else μ."""
    return batch.get("old_logp_BxT", batch["behaviour_logp_BxT"])


def _is_weight(batch: Batch) -> jnp.ndarray | float:
    return batch.get("is_weight_BxT", 1.0)


def _clipped_surrogate(ratio_BxT, adv_BxT, clip_low, clip_high, dual_clip_c):
    """min(r·A, clip(r)·A), with the dual-clip floor c·A for A < 0 when c > 0."""
    surrogate = jnp.minimum(ratio_BxT * adv_BxT,
                            jnp.clip(ratio_BxT, 1.0 - clip_low, 1.0 + clip_high) * adv_BxT)
    if dual_clip_c > 0:
        # Dual clip (Ye et al. 2020): for A < 0 an unbounded ratio would give an
        # unbounded loss; cap its contribution at c·A.
        surrogate = jnp.where(adv_BxT < 0, jnp.maximum(surrogate, dual_clip_c * adv_BxT), surrogate)
    return surrogate


def _clip_metrics(ratio, adv, mask, clip_low, clip_high, dual_clip_c) -> Metrics:
    # A token is clipped when the clipped branch is the active one (zero gradient).
    high = ((ratio > 1.0 + clip_high) & (adv > 0)).astype(jnp.float32)
    low = ((ratio < 1.0 - clip_low) & (adv < 0)).astype(jnp.float32)
    metrics = {"clip_frac": token_mean(high + low, mask), "clip_frac_high": token_mean(high, mask),
               "clip_frac_low": token_mean(low, mask), "ratio_mean": token_mean(ratio, mask)}
    if dual_clip_c > 0:
        dual = ((ratio > dual_clip_c) & (adv < 0)).astype(jnp.float32)
        metrics["dual_clip_frac"] = token_mean(dual, mask)
    return metrics


@register(LOSS_TERMS, "ppo_clip")
def ppo_clip_loss(logp_BxT: jnp.ndarray, batch: Batch, *, clip_low: float = 0.2,
                  clip_high: float = 0.28, dual_clip_c: float = 0.0) -> tuple[jnp.ndarray, Metrics]:
    """PPO clip: -min(r·A, clip(r, 1-ε_low, 1+ε_high)·A), r = π/anchor.

    Symmetric when clip_low == clip_high, clip-higher (DAPO) when clip_high is larger;
    dual_clip_c > 1 adds the dual-clip floor for negative advantages. Against μ the
    same ratio corrects both staleness and train/inference mismatch.
    """
    mask, adv = batch["mask_BxT"], advantages_BxT(batch)
    ratio = jnp.exp(logp_BxT - _anchor(batch))
    per_token = -_clipped_surrogate(ratio, adv, clip_low, clip_high, dual_clip_c) * _is_weight(batch)
    return aggregate(per_token, batch), _clip_metrics(ratio, adv, mask, clip_low, clip_high,
                                                      dual_clip_c)


# The name the first fnrl configs used for the same term.
register(LOSS_TERMS, "grpo")(ppo_clip_loss)


@register(LOSS_TERMS, "aipo")
def aipo_loss(logp_BxT: jnp.ndarray, batch: Batch, *, aipo_rho: float = 4.0
              ) -> tuple[jnp.ndarray, Metrics]:
    """AIPO (LlamaRL §6): gradient Σ_t min(π/μ, ρ)·A·∇log π.

    One-sided truncation: no lower bound, no dependence on the sign of A, and tokens
    with π/μ above ρ still get gradient, weighted by ρ (unlike PPO's zero). The value
    is -min(π/μ, ρ)·A: exp(logp - sg(logp)) is 1 but carries ∇log π.
    """
    mask, adv = batch["mask_BxT"], advantages_BxT(batch)
    ratio = jnp.exp(logp_BxT - batch["behaviour_logp_BxT"])
    weight = _sg(jnp.minimum(ratio, aipo_rho))
    per_token = -weight * adv * jnp.exp(logp_BxT - _sg(logp_BxT))
    metrics = {"truncated_frac": token_mean((ratio > aipo_rho).astype(jnp.float32), mask),
               "ratio_mean": token_mean(ratio, mask)}
    return aggregate(per_token, batch), metrics


@register(LOSS_TERMS, "decoupled_ppo")
def decoupled_ppo_loss(logp_BxT: jnp.ndarray, batch: Batch, *, clip_low: float = 0.2,
                       clip_high: float = 0.28, behaviour_cap: float = 0.0
                       ) -> tuple[jnp.ndarray, Metrics]:
    """AReaL's decoupled PPO: clip around the proximal policy, importance-weight by μ.

    -(π_prox/μ)·min(r·A, clip(r)·A) with r = π/π_prox. π_prox is `old_logp_BxT`, or
    the current parameters' log-probs (constant) when absent, since fnrl applies one
    optimizer update per batch. Tokens with π_prox/μ > behaviour_cap are dropped,
    as AReaL does, when the cap is > 0.
    """
    mask, adv = batch["mask_BxT"], advantages_BxT(batch)
    prox = batch.get("old_logp_BxT", _sg(logp_BxT))
    behaviour_weight = _sg(jnp.exp(prox - batch["behaviour_logp_BxT"]))
    keep = jnp.ones_like(mask)
    if behaviour_cap > 0:
        keep = (behaviour_weight <= behaviour_cap).astype(mask.dtype)
    ratio = jnp.exp(logp_BxT - prox)
    surrogate = _clipped_surrogate(ratio, adv, clip_low, clip_high, 0.0)
    per_token = -behaviour_weight * surrogate * keep
    metrics = _clip_metrics(ratio, adv, mask, clip_low, clip_high, 0.0)
    metrics["behaviour_weight_mean"] = token_mean(behaviour_weight, mask)
    metrics["behaviour_capped_frac"] = token_mean(1.0 - keep, mask)
    return aggregate(per_token, batch), metrics


@register(LOSS_TERMS, "gspo")
def gspo_loss(logp_BxT: jnp.ndarray, batch: Batch, *, gspo_clip_low: float = 3e-4,
              gspo_clip_high: float = 4e-4) -> tuple[jnp.ndarray, Metrics]:
    """GSPO: one importance ratio per sequence, s = exp(mean_t log(π_t/anchor_t)).

    Written per token as s_t = sg(s)·π_t/sg(π_t) (GSPO-token), so the value is s and
    ∇ = s·∇log π_t; with `seq_mean_token_mean` aggregation this is GSPO's objective
    (1/G)Σ_i min(s_i·A_i, clip(s_i)·A_i). The clip range is far narrower than PPO's.
    """
    mask, adv = batch["mask_BxT"], advantages_BxT(batch)
    log_s_BxT = sequence_mean(logp_BxT - _anchor(batch), batch)
    ratio = jnp.exp(_sg(log_s_BxT) + logp_BxT - _sg(logp_BxT))
    surrogate = _clipped_surrogate(ratio, adv, gspo_clip_low, gspo_clip_high, 0.0)
    per_token = -surrogate * _is_weight(batch)
    return aggregate(per_token, batch), _clip_metrics(ratio, adv, mask, gspo_clip_low,
                                                      gspo_clip_high, 0.0)
