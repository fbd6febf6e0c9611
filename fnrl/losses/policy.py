"""Policy-gradient loss terms: PPO clip, AIPO, AReaL's decoupled PPO, GSPO, CISPO, SAPO,
GMPO and GPG. (Clip-Cov and KL-Cov are in fnrl.losses.covariance.)

All take μ (`behaviour_logp_BxT`) from the batch: the log-probs vLLM actually
sampled with, shipped with every token. When the trainer applies a train/inference
mismatch correction it also sets `old_logp_BxT` (π_old) and `is_weight_BxT`; the
ratio-based terms then take their ratio against π_old and multiply by the correction
weight.

Robust defaults (issue 15). In an async run a stale token can have log(π/μ) = 20.
With A < 0 the PPO surrogate max(r, clip(r))·|A| then gives a loss and a gradient of
e^20·|A| ≈ 5·10^8·|A|, enough to wreck a step. So:
  - every log ratio is clamped to ±20 before exp (core.log_ratio), so no value or
    gradient can become inf or NaN;
  - the dual clip (Ye et al. 2020, arXiv 1912.09729) is on by default with c = 3, as
    in verl: for A < 0 a token's loss is at most c·|A| and, above c, it gets no
    gradient. Terms whose ratio is unbounded for A < 0 (ppo_clip, gspo, gmpo,
    clip_cov, kl_cov) all take the floor; `dual_clip_c = 0` turns it off and gives
    the papers' objectives (KL-Cov also keeps PPO's clip: fnrl.losses.covariance);
  - decoupled PPO drops tokens with π_prox/μ > 5 by default (AReaL drops above a cap it
    leaves to the user; 5 is our choice).
The other terms are bounded by construction: AIPO and CISPO truncate the weight, SAPO's
gate saturates at 4/τ, GPG has no ratio.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fnrl.losses.core import (LOSS_TERMS, Batch, Metrics, advantages_BxT, aggregate, log_ratio,
                              register, sequence_mean, token_mean)

_sg = jax.lax.stop_gradient


def anchor_logp(batch: Batch) -> jnp.ndarray:
    """The clip anchor: π_old when a correction supplies it, else μ."""
    return batch.get("old_logp_BxT", batch["behaviour_logp_BxT"])


def correction_weight(batch: Batch) -> jnp.ndarray | float:
    """The mismatch correction's per-token weight, 1 without a correction."""
    return batch.get("is_weight_BxT", 1.0)


def dual_clip(surrogate_BxT, adv_BxT, dual_clip_c):
    """The dual-clip floor: for A < 0 the surrogate is at least c·A (off when c = 0)."""
    if dual_clip_c <= 0:
        return surrogate_BxT
    # Dual clip (Ye et al. 2020): for A < 0 an unbounded ratio would give an unbounded
    # loss; cap its contribution at c·|A| (the floor is constant: no gradient).
    return jnp.where(adv_BxT < 0, jnp.maximum(surrogate_BxT, dual_clip_c * adv_BxT), surrogate_BxT)


def clipped_surrogate(ratio_BxT, adv_BxT, clip_low, clip_high, dual_clip_c):
    """min(r·A, clip(r)·A), with the dual-clip floor c·A for A < 0 when c > 0."""
    surrogate = jnp.minimum(ratio_BxT * adv_BxT,
                            jnp.clip(ratio_BxT, 1.0 - clip_low, 1.0 + clip_high) * adv_BxT)
    return dual_clip(surrogate, adv_BxT, dual_clip_c)


def clipped_by_ppo(ratio, adv, clip_low, clip_high) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(high, low): tokens where PPO's clipped branch is active (zero gradient)."""
    high = ((ratio > 1.0 + clip_high) & (adv > 0)).astype(jnp.float32)
    low = ((ratio < 1.0 - clip_low) & (adv < 0)).astype(jnp.float32)
    return high, low


def _clip_metrics(ratio, adv, mask, clip_low, clip_high, dual_clip_c) -> Metrics:
    high, low = clipped_by_ppo(ratio, adv, clip_low, clip_high)
    metrics = {"clip_frac": token_mean(high + low, mask), "clip_frac_high": token_mean(high, mask),
               "clip_frac_low": token_mean(low, mask), "ratio_mean": token_mean(ratio, mask)}
    if dual_clip_c > 0:
        dual = ((ratio > dual_clip_c) & (adv < 0)).astype(jnp.float32)
        metrics["dual_clip_frac"] = token_mean(dual, mask)
    return metrics


@register(LOSS_TERMS, "ppo_clip")
def ppo_clip_loss(logp_BxT: jnp.ndarray, batch: Batch, *, clip_low: float = 0.2,
                  clip_high: float = 0.28, dual_clip_c: float = 3.0) -> tuple[jnp.ndarray, Metrics]:
    """PPO clip: -min(r·A, clip(r, 1-ε_low, 1+ε_high)·A), r = π/anchor.

    PPO (arXiv 1707.06347); clip-higher from DAPO (arXiv 2503.14476) when clip_high is
    larger than clip_low. dual_clip_c > 1 (default 3) is the dual-clip floor for
    negative advantages (arXiv 1912.09729); 0 turns it off. Against μ the same ratio
    corrects both staleness and train/inference mismatch.
    """
    mask, adv = batch["mask_BxT"], advantages_BxT(batch)
    ratio = jnp.exp(log_ratio(logp_BxT, anchor_logp(batch)))
    surrogate = clipped_surrogate(ratio, adv, clip_low, clip_high, dual_clip_c)
    per_token = -surrogate * correction_weight(batch)
    return aggregate(per_token, batch), _clip_metrics(ratio, adv, mask, clip_low, clip_high,
                                                      dual_clip_c)


# The name the first fnrl configs used for the same term.
register(LOSS_TERMS, "grpo")(ppo_clip_loss)


@register(LOSS_TERMS, "aipo")
def aipo_loss(logp_BxT: jnp.ndarray, batch: Batch, *, aipo_rho: float = 4.0
              ) -> tuple[jnp.ndarray, Metrics]:
    """AIPO (LlamaRL §6, arXiv 2505.24034): gradient Σ_t min(π/μ, ρ)·A·∇log π.

    One-sided truncation: no lower bound, no dependence on the sign of A, and tokens
    with π/μ above ρ still get gradient, weighted by ρ (unlike PPO's zero). The value
    is -min(π/μ, ρ)·A: exp(logp - sg(logp)) is 1 but carries ∇log π.
    """
    mask, adv = batch["mask_BxT"], advantages_BxT(batch)
    ratio = jnp.exp(log_ratio(logp_BxT, batch["behaviour_logp_BxT"]))
    weight = _sg(jnp.minimum(ratio, aipo_rho))
    per_token = -weight * adv * jnp.exp(logp_BxT - _sg(logp_BxT))
    metrics = {"truncated_frac": token_mean((ratio > aipo_rho).astype(jnp.float32), mask),
               "ratio_mean": token_mean(ratio, mask)}
    return aggregate(per_token, batch), metrics


@register(LOSS_TERMS, "decoupled_ppo")
def decoupled_ppo_loss(logp_BxT: jnp.ndarray, batch: Batch, *, clip_low: float = 0.2,
                       clip_high: float = 0.28, behaviour_cap: float = 5.0
                       ) -> tuple[jnp.ndarray, Metrics]:
    """AReaL's decoupled PPO (arXiv 2505.24298): clip around the proximal policy,
    importance-weight by μ.

    -(π_prox/μ)·min(r·A, clip(r)·A) with r = π/π_prox. π_prox is `old_logp_BxT`, or
    the current parameters' log-probs (constant) when absent, since fnrl applies one
    optimizer update per batch. Tokens with π_prox/μ > behaviour_cap (default 5) are
    dropped, as AReaL does; 0 keeps them all, however stale (unbounded weight).
    """
    mask, adv = batch["mask_BxT"], advantages_BxT(batch)
    prox = batch.get("old_logp_BxT", _sg(logp_BxT))
    behaviour_weight = _sg(jnp.exp(log_ratio(prox, batch["behaviour_logp_BxT"])))
    keep = jnp.ones_like(mask)
    if behaviour_cap > 0:
        keep = (behaviour_weight <= behaviour_cap).astype(mask.dtype)
    ratio = jnp.exp(log_ratio(logp_BxT, prox))
    surrogate = clipped_surrogate(ratio, adv, clip_low, clip_high, 0.0)
    per_token = -behaviour_weight * surrogate * keep
    metrics = _clip_metrics(ratio, adv, mask, clip_low, clip_high, 0.0)
    metrics["behaviour_weight_mean"] = token_mean(behaviour_weight, mask)
    metrics["behaviour_capped_frac"] = token_mean(1.0 - keep, mask)
    return aggregate(per_token, batch), metrics


@register(LOSS_TERMS, "gspo")
def gspo_loss(logp_BxT: jnp.ndarray, batch: Batch, *, gspo_clip_low: float = 3e-4,
              gspo_clip_high: float = 4e-4, dual_clip_c: float = 3.0
              ) -> tuple[jnp.ndarray, Metrics]:
    """GSPO (arXiv 2507.18071): one ratio per sequence, s = exp(mean_t log(π_t/anchor_t)).

    Written per token as s_t = sg(s)·π_t/sg(π_t) (GSPO-token), so the value is s and
    ∇ = s·∇log π_t; with `seq_mean_token_mean` aggregation this is GSPO's objective
    (1/G)Σ_i min(s_i·A_i, clip(s_i)·A_i). The clip range is far narrower than PPO's.
    Ours: the dual-clip floor (default c = 3) bounds a stale sequence with A < 0, which
    GSPO's one-sided clip leaves unbounded; dual_clip_c = 0 is the paper's objective.
    """
    mask, adv = batch["mask_BxT"], advantages_BxT(batch)
    log_s_BxT = sequence_mean(log_ratio(logp_BxT, anchor_logp(batch)), batch)
    ratio = jnp.exp(_sg(log_s_BxT) + logp_BxT - _sg(logp_BxT))
    surrogate = clipped_surrogate(ratio, adv, gspo_clip_low, gspo_clip_high, dual_clip_c)
    per_token = -surrogate * correction_weight(batch)
    return aggregate(per_token, batch), _clip_metrics(ratio, adv, mask, gspo_clip_low,
                                                      gspo_clip_high, dual_clip_c)


@register(LOSS_TERMS, "cispo")
def cispo_loss(logp_BxT: jnp.ndarray, batch: Batch, *, cispo_clip_low: float = 1.0,
               cispo_clip_high: float = 3.0) -> tuple[jnp.ndarray, Metrics]:
    """CISPO (MiniMax-M1, arXiv 2506.13585 §3.1): -sg(clip(r, 1-ε_low, 1+ε_high))·A·log π.

    The importance weight is clipped and detached instead of the update: no token is
    dropped, a token whose ratio left the range still gets A·∇log π, scaled by the
    bounded weight. The paper sets no lower bound ("ε_low large"); cispo_clip_low = 1
    does that (weights ≥ 0). It does not publish its ε_high: the default 3 (weight cap 4)
    is our choice, Tinker's default cap. Close to AIPO, but against the anchor (π_old
    under a correction, else μ) and with an optional lower bound.
    """
    mask, adv = batch["mask_BxT"], advantages_BxT(batch)
    ratio = jnp.exp(log_ratio(logp_BxT, anchor_logp(batch)))
    weight = _sg(jnp.clip(ratio, 1.0 - cispo_clip_low, 1.0 + cispo_clip_high))
    per_token = -weight * adv * logp_BxT * correction_weight(batch)
    high = (ratio > 1.0 + cispo_clip_high).astype(jnp.float32)
    low = (ratio < 1.0 - cispo_clip_low).astype(jnp.float32)
    metrics = {"clip_frac": token_mean(high + low, mask), "clip_frac_high": token_mean(high, mask),
               "ratio_mean": token_mean(ratio, mask), "is_weight_mean": token_mean(weight, mask)}
    return aggregate(per_token, batch), metrics


@register(LOSS_TERMS, "sapo")
def sapo_loss(logp_BxT: jnp.ndarray, batch: Batch, *, sapo_tau_pos: float = 1.0,
              sapo_tau_neg: float = 1.05) -> tuple[jnp.ndarray, Metrics]:
    """SAPO (Qwen, arXiv 2511.20347): a soft gate f(r) = (4/τ)·σ(τ·(r - 1)) for the hard clip.

    Loss -f(r)·A per token, τ = τ_pos for A > 0 and τ_neg otherwise. Its gradient is
    -A·4σ(1-σ)·r·∇log π: exactly -A·∇log π on policy (r = 1), decaying smoothly as r
    leaves 1 (faster for the larger τ_neg: the paper's argument is that negative updates
    spread mass over many unsampled tokens). The value is bounded by 4/τ·|A|. Defaults
    are the paper's (1.0, 1.05). The paper averages the token gates over each sequence,
    then over sequences: this term under `seq_mean_token_mean` aggregation.
    """
    mask, adv = batch["mask_BxT"], advantages_BxT(batch)
    ratio = jnp.exp(log_ratio(logp_BxT, anchor_logp(batch)))
    tau = jnp.where(adv > 0, sapo_tau_pos, sapo_tau_neg)
    gate = jax.nn.sigmoid(tau * (ratio - 1.0))
    per_token = -(4.0 / tau) * gate * adv * correction_weight(batch)
    # The factor the gate puts on the plain policy gradient (1 on policy).
    grad_weight = _sg(4.0 * gate * (1.0 - gate) * ratio)
    metrics = {"ratio_mean": token_mean(ratio, mask),
               "grad_weight_mean": token_mean(grad_weight, mask)}
    return aggregate(per_token, batch), metrics


@register(LOSS_TERMS, "gmpo")
def gmpo_loss(logp_BxT: jnp.ndarray, batch: Batch, *, gmpo_clip_low: float = 0.4,
              gmpo_clip_high: float = 0.4, dual_clip_c: float = 3.0
              ) -> tuple[jnp.ndarray, Metrics]:
    """GMPO (arXiv 2507.20673): the geometric mean of the token ratios of each sequence.

    s = exp(mean_t ℓ_t), where ℓ_t is log(π/anchor) clipped in log space to
    [-ε_low, ε_high] on the pessimistic side only, as PPO does per token: for A > 0 a
    token above ε_high is held at ε_high (no gradient), for A < 0 one below -ε_low.
    Loss -s·A. The geometric mean is less sensitive to one outlier token than GRPO's
    arithmetic mean, which allows the wider range (e^±0.4, the paper's default). Under
    `seq_mean_token_mean` aggregation this is the paper's (1/G)Σ_i s_i·A_i. Ours: the
    dual-clip floor bounds A < 0 (dual_clip_c = 0 is the paper's objective), and A is
    taken per token, which is the paper's when A is constant along a sequence.
    """
    mask, adv = batch["mask_BxT"], advantages_BxT(batch)
    log_r = log_ratio(logp_BxT, anchor_logp(batch))
    sign = jnp.sign(adv)
    clipped = jnp.clip(log_r, -gmpo_clip_low, gmpo_clip_high)
    pessimistic = sign * jnp.minimum(sign * log_r, sign * clipped)
    s_BxT = jnp.exp(sequence_mean(pessimistic, batch))
    surrogate = dual_clip(s_BxT * adv, adv, dual_clip_c)
    per_token = -surrogate * correction_weight(batch)
    high = ((log_r > gmpo_clip_high) & (adv > 0)).astype(jnp.float32)
    low = ((log_r < -gmpo_clip_low) & (adv < 0)).astype(jnp.float32)
    metrics = {"clip_frac": token_mean(high + low, mask), "clip_frac_high": token_mean(high, mask),
               "clip_frac_low": token_mean(low, mask), "ratio_mean": token_mean(s_BxT, mask)}
    return aggregate(per_token, batch), metrics


@register(LOSS_TERMS, "gpg")
def gpg_loss(logp_BxT: jnp.ndarray, batch: Batch) -> tuple[jnp.ndarray, Metrics]:
    """GPG (arXiv 2504.02546): plain REINFORCE, -A·log π, no ratio and no clip.

    Pair it with the `gpg` advantages (group-centred, rescaled for zero-variance groups).
    It assumes on-policy samples: in an async run set a mismatch correction, whose
    weight then multiplies every token (the paper has none).
    """
    adv = advantages_BxT(batch)
    per_token = -adv * logp_BxT * correction_weight(batch)
    return aggregate(per_token, batch), {"logp_mean": token_mean(_sg(logp_BxT), batch["mask_BxT"])}
