"""Clip-Cov and KL-Cov: entropy control by the tokens that drive entropy down.

"The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models"
(Cui et al., arXiv 2505.22617) shows that under policy gradient the step's change of
entropy follows minus the covariance, over tokens, between log π(y_t) and A_t. A few
tokens with a large positive covariance (confident and rewarded) collapse the entropy.
Both terms find them per token,

    cov_t = (A_t - mean A)·(log π_t - mean log π)     (means over the batch's tokens)

and restrain only that small fraction:
  clip_cov  PPO clip, with the gradient of up to clip_cov_ratio·N tokens whose cov lies
            in (clip_cov_lb, clip_cov_ub) detached (paper §4, "Clip-Cov");
  kl_cov    the surrogate, plus kl_cov_coef·|log r| on the kl_cov_ratio·N tokens of
            largest cov (paper §4, "KL-Cov"; |log r| estimates KL(π_old‖π) as verl does).

Gaps we filled: the paper picks Clip-Cov's tokens at random inside the band; we take
those with the largest cov (deterministic, so a replay reproduces the step, and the same
tokens the paper's argument singles out). Statistics and selection are over the batch
the term sees, i.e. per micro-batch when the step is split (verl does the same). As
every fnrl ratio term, both take the dual-clip floor for A < 0. And KL-Cov keeps PPO's
clip, which the paper drops: against μ in an async run a stale token's r·A is unbounded
for either sign of A (e^20·A at a log ratio of 20). With dual_clip_c = 0 and wide clip
bounds this is the paper's objective.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fnrl.losses.core import (LOSS_TERMS, Batch, Metrics, advantages_BxT, aggregate, log_ratio,
                              register, token_mean)
from fnrl.losses.policy import anchor_logp, clipped_by_ppo, clipped_surrogate, correction_weight

_sg = jax.lax.stop_gradient


def covariance_BxT(logp_BxT: jnp.ndarray, batch: Batch) -> jnp.ndarray:
    """Per-token centred product (A_t - mean A)·(log π_t - mean log π), constant."""
    mask = batch["mask_BxT"]
    adv = jnp.broadcast_to(advantages_BxT(batch), logp_BxT.shape)
    logp = _sg(logp_BxT)
    return (adv - token_mean(adv, mask)) * (logp - token_mean(logp, mask))


def top_fraction(score_BxT: jnp.ndarray, eligible_BxT: jnp.ndarray, mask_BxT: jnp.ndarray,
                 fraction: float) -> jnp.ndarray:
    """1.0 on the max(1, ⌊fraction·N⌋) eligible tokens of largest score (N: response
    tokens), earlier positions first among equal scores; fewer if fewer are eligible."""
    k = jnp.maximum(jnp.floor(fraction * jnp.sum(mask_BxT)), 1.0)
    flat = jnp.where(eligible_BxT, score_BxT, -jnp.inf).reshape(-1)
    order = jnp.argsort(flat, descending=True, stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    chosen = (rank.reshape(score_BxT.shape) < k) & eligible_BxT
    return chosen.astype(jnp.float32)


@register(LOSS_TERMS, "clip_cov")
def clip_cov_loss(logp_BxT: jnp.ndarray, batch: Batch, *, clip_low: float = 0.2,
                  clip_high: float = 0.28, dual_clip_c: float = 3.0, clip_cov_ratio: float = 2e-4,
                  clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0
                  ) -> tuple[jnp.ndarray, Metrics]:
    """Clip-Cov (arXiv 2505.22617): PPO clip, with high-covariance tokens' gradient detached.

    Candidates are response tokens PPO has not clipped already whose cov is in
    (clip_cov_lb, clip_cov_ub); up to clip_cov_ratio of the response tokens (at least
    one) are detached. Their loss value stays, their gradient is 0. Defaults are the
    paper's (r = 2·10⁻⁴, band (1, 5)).
    """
    mask, adv = batch["mask_BxT"], advantages_BxT(batch)
    ratio = jnp.exp(log_ratio(logp_BxT, anchor_logp(batch)))
    surrogate = clipped_surrogate(ratio, adv, clip_low, clip_high, dual_clip_c)
    high, low = clipped_by_ppo(ratio, adv, clip_low, clip_high)
    cov = covariance_BxT(logp_BxT, batch)
    eligible = (mask > 0) & (high + low == 0) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    detached = top_fraction(cov, eligible, mask, clip_cov_ratio)
    surrogate = jnp.where(detached > 0, _sg(surrogate), surrogate)
    per_token = -surrogate * correction_weight(batch)
    metrics = {"clip_frac": token_mean(high + low, mask),
               "cov_detached_frac": token_mean(detached, mask),
               "cov_mean": token_mean(cov, mask), "ratio_mean": token_mean(ratio, mask)}
    return aggregate(per_token, batch), metrics


@register(LOSS_TERMS, "kl_cov")
def kl_cov_loss(logp_BxT: jnp.ndarray, batch: Batch, *, clip_low: float = 0.2,
                clip_high: float = 0.28, dual_clip_c: float = 3.0, kl_cov_ratio: float = 2e-3,
                kl_cov_coef: float = 1.0) -> tuple[jnp.ndarray, Metrics]:
    """KL-Cov (arXiv 2505.22617): the PPO surrogate, plus kl_cov_coef·|log r| on the
    top-cov tokens.

    The kl_cov_ratio·N response tokens (at least one) of largest cov get the penalty,
    which pulls them back towards the anchor instead of cutting their gradient. The
    paper drops PPO's clip; we keep it (module docstring). Defaults: k = 2·10⁻³ (the
    paper's for 7B models; it uses 2·10⁻⁴ at 32B) and β = 1 (verl's).
    """
    mask, adv = batch["mask_BxT"], advantages_BxT(batch)
    log_r = log_ratio(logp_BxT, anchor_logp(batch))
    ratio = jnp.exp(log_r)
    surrogate = clipped_surrogate(ratio, adv, clip_low, clip_high, dual_clip_c)
    cov = covariance_BxT(logp_BxT, batch)
    penalised = top_fraction(cov, mask > 0, mask, kl_cov_ratio)
    per_token = -surrogate * correction_weight(batch) + kl_cov_coef * penalised * jnp.abs(log_r)
    metrics = {"cov_penalised_frac": token_mean(penalised, mask), "cov_mean": token_mean(cov, mask),
               "kl_abs": token_mean(jnp.abs(log_r), mask), "ratio_mean": token_mean(ratio, mask)}
    return aggregate(per_token, batch), metrics
