"""KL to a frozen reference policy (as a loss term or in the reward) and entropy.

Estimators of KL(π‖π_ref) from tokens y_t (Schulman, "Approximating KL divergence"),
with d = log π_ref(y_t) - log π(y_t):
  k1 = -d                 unbiased, high variance, can be negative
  k2 = d² / 2             biased, low variance; its gradient is that of the true KL
  k3 = exp(d) - 1 - d     unbiased, always ≥ 0 (GRPO's choice)
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from fnrl.losses.core import LOSS_TERMS, Batch, Metrics, aggregate, register, token_mean

KL_ESTIMATORS: dict[str, Callable[[jnp.ndarray, jnp.ndarray], jnp.ndarray]] = {
    "k1": lambda logp, ref: logp - ref,
    "k2": lambda logp, ref: 0.5 * jnp.square(ref - logp),
    "k3": lambda logp, ref: jnp.exp(ref - logp) - 1.0 - (ref - logp),
}


def kl_BxT(logp_BxT: jnp.ndarray, ref_logp_BxT: jnp.ndarray, estimator: str = "k3") -> jnp.ndarray:
    """Per-token KL(π‖π_ref) estimate."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; known: {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](logp_BxT, ref_logp_BxT)


@register(LOSS_TERMS, "kl", needs=("ref_logp_BxT",))
def kl_loss(logp_BxT: jnp.ndarray, batch: Batch, *, kl_estimator: str = "k3"
            ) -> tuple[jnp.ndarray, Metrics]:
    """KL(π‖π_ref) as a loss term; its weight is the KL coefficient."""
    kl = kl_BxT(logp_BxT, batch["ref_logp_BxT"], kl_estimator)
    return aggregate(kl, batch), {"kl": token_mean(kl, batch["mask_BxT"])}


@register(LOSS_TERMS, "entropy", needs=("entropy_BxT",))
def entropy_loss(logp_BxT: jnp.ndarray, batch: Batch) -> tuple[jnp.ndarray, Metrics]:
    """Minus the mean token entropy: a positive weight is an entropy bonus."""
    entropy = batch["entropy_BxT"]
    return aggregate(-entropy, batch), {"entropy": token_mean(entropy, batch["mask_BxT"])}


@register(LOSS_TERMS, "router_balance", needs=("router_aux_loss",))
def router_balance_loss(logp_BxT: jnp.ndarray, batch: Batch) -> tuple[jnp.ndarray, Metrics]:
    """A mixture of experts' load-balancing loss (Switch/Qwen: X · Σ_e f_e · P_e over the
    batch's tokens, fnrl.models.moe), as the trainer's forward pass computed it; its
    weight is the model's `router_aux_loss_coef` (Qwen3-MoE's is 0.001). A scalar of the
    micro-batch, scaled by the trainer by its share of the batch's tokens, so micro-batches
    sum to a token-weighted mean as every loss does (the trainer logs it unscaled as
    router/aux_loss)."""
    return batch["router_aux_loss"], {}


def _segment_starts(batch: Batch) -> jnp.ndarray:
    """True where a token starts a new sequence, scanning each row right to left."""
    if "segment_ids_BxT" not in batch:
        return jnp.zeros(batch["mask_BxT"].shape, bool).at[:, -1].set(True)
    seg = batch["segment_ids_BxT"]
    nxt = jnp.concatenate([seg[:, 1:], jnp.full_like(seg[:, :1], -1)], axis=1)
    return seg != nxt


def kl_to_go(kl_BxT: jnp.ndarray, batch: Batch) -> jnp.ndarray:
    """Σ_{t' ≥ t} kl_t' within each token's own sequence (packed rows reset per segment).

    The return of the per-token reward -kl_t, undiscounted: what the KL penalty adds
    to the advantage of token t when the KL is put in the reward.
    """
    x = (kl_BxT * batch["mask_BxT"])[:, ::-1]
    reset = _segment_starts(batch)[:, ::-1]

    # Segmented prefix sum: a reset flag on the right operand discards the left sum.
    def combine(a, b):
        return jnp.where(b[1], b[0], a[0] + b[0]), a[1] | b[1]

    sums, _ = jax.lax.associative_scan(combine, (x, reset), axis=1)
    return sums[:, ::-1]


def kl_reward_advantages(adv_BxT: jnp.ndarray, logp_BxT: jnp.ndarray, batch: Batch, *,
                         coef: float, estimator: str) -> jnp.ndarray:
    """Advantages with the KL penalty in the reward: A_t - coef·Σ_{t'≥t} kl_t' (constant)."""
    kl = jax.lax.stop_gradient(kl_BxT(logp_BxT, batch["ref_logp_BxT"], estimator))
    return adv_BxT - coef * kl_to_go(kl, batch)
