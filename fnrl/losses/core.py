"""Pure loss terms and advantage estimators, chosen by registered name.

A policy loss term maps the new per-token log-probs and an immutable batch to a
scalar and a dict of metrics. Batches are dicts of arrays with shape suffixes:
`target_BxT`, `mask_BxT` (1 on response tokens), `behaviour_logp_BxT` (what vLLM
sampled with), `adv_B`.
"""

from __future__ import annotations

from typing import Callable, Mapping

import jax.numpy as jnp
import numpy as np

Batch = Mapping[str, jnp.ndarray]
LossFn = Callable[..., tuple[jnp.ndarray, dict[str, jnp.ndarray]]]

POLICY_LOSSES: dict[str, LossFn] = {}
ADVANTAGES: dict[str, Callable[..., np.ndarray]] = {}


def register(table: dict, name: str):
    def wrap(fn):
        if name in table:
            raise ValueError(f"{name!r} is already registered")
        table[name] = fn
        return fn
    return wrap


def token_mean(x_BxT: jnp.ndarray, mask_BxT: jnp.ndarray) -> jnp.ndarray:
    """Token-level aggregation (DAPO): every response token in the batch weighs the same."""
    return jnp.sum(x_BxT * mask_BxT) / jnp.maximum(jnp.sum(mask_BxT), 1.0)


@register(POLICY_LOSSES, "grpo")
def grpo_clip_loss(logp_BxT: jnp.ndarray, batch: Batch, *, clip_low: float = 0.2,
                   clip_high: float = 0.28) -> tuple[jnp.ndarray, dict[str, jnp.ndarray]]:
    """PPO-clip surrogate with clip-higher (DAPO): ratio in [1-ε_low, 1+ε_high].

    The ratio is taken against the behaviour log-probs returned by vLLM, so staleness
    and train/inference mismatch are both corrected by the same importance weight.
    """
    mask, adv = batch["mask_BxT"], batch["adv_B"][:, None]
    log_ratio = logp_BxT - batch["behaviour_logp_BxT"]
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = -jnp.minimum(ratio * adv, clipped * adv)
    loss = token_mean(per_token, mask)
    is_clipped = (jnp.abs(per_token - (-ratio * adv)) > 0).astype(jnp.float32)
    metrics = {
        "clip_frac": token_mean(is_clipped, mask),
        "ratio_mean": token_mean(ratio, mask),
        # k3 estimator of KL(behaviour || current), a mismatch/staleness signal.
        "kl_behaviour": token_mean(jnp.exp(-log_ratio) - 1.0 + log_ratio, mask),
        "logp_abs_diff": token_mean(jnp.abs(log_ratio), mask),
    }
    return loss, metrics


@register(ADVANTAGES, "grpo")
def grpo_advantages(rewards_GxN: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Group-normalized advantages: (r - mean_group) / (std_group + eps)."""
    r = np.asarray(rewards_GxN, dtype=np.float32)
    mean = r.mean(axis=1, keepdims=True)
    std = r.std(axis=1, keepdims=True)
    return (r - mean) / (std + eps)
