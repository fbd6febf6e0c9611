"""PPO with a learned critic: generalised advantage estimation and the value loss.

The critic is a value head on the policy's trunk: V(s_t) = w·h_t + b over the final
hidden state h_t at the position that predicts token t, so V sits on the same B×T grid
as the log-probs and shares the trainer's mesh and micro-batches (fnrl.trainer.step).
Its parameters and optimizer are the TrainState's `critic`; `value_trunk_grad` says
whether the value loss also trains the trunk (the shared-trunk PPO of Ziegler et al.
2019, arXiv 1909.08593, and TRL) or the head alone reads the policy's features.

GAE (Schulman et al. 2015, arXiv 1506.02438), per sequence, over its trained tokens:
    δ_t = r_t + γ·V_{t'} − V_t,   A_t = δ_t + γλ·A_{t'}
where t' is the sequence's next trained token (none after the last, V = A = 0 there).
The reward r_t is 0 except at the last response token, which carries the sequence's
reward (the verifiable outcome, after the same shaping the group advantages see).
Returns R_t = A_t + V_t are the value targets. Filling the paper's gaps:
  - Tokens with mask 0 inside a sequence (a tool's output in a multi-turn episode) are
    skipped, not stepped through: γ discounts per sampled token, so an environment's
    reply neither earns nor costs discount. Packed rows restart at every segment.
  - V_old, the values GAE and the value clip read, are the critic's own values in the
    same forward pass, before the update (fnrl trains one update per batch, so they
    equal the values at rollout time up to the policy's staleness).
  - The advantages are not whitened over the batch: whitening would make the update
    depend on how the step is split into micro-batches, which fnrl keeps exact.
Defaults γ = 1, λ = 0.95 (OpenRLHF's; verl uses λ = 1), value clip 0.2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fnrl.losses.core import ADVANTAGES, LOSS_TERMS, Batch, Metrics, aggregate, register, token_mean

_sg = jax.lax.stop_gradient


def gae(reward_BxT: jnp.ndarray, values_BxT: jnp.ndarray, mask_BxT: jnp.ndarray,
        segment_ids_BxT: jnp.ndarray | None = None, *, gamma: float, lam: float
        ) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(advantages, returns), B×T, zero where mask is 0: GAE over each sequence's trained
    tokens (see the module docstring), by one reverse scan over positions."""
    values_BxT = values_BxT.astype(jnp.float32)
    trained_BxT = mask_BxT > 0
    seg_BxT = (jnp.ones_like(mask_BxT, jnp.int32) if segment_ids_BxT is None
               else segment_ids_BxT.astype(jnp.int32))

    def back(carry, xs):
        next_v, next_a, next_seg = carry           # the next trained token's, per row
        r, v, trained, seg = xs
        follows = next_seg == seg                  # a later trained token of this sequence
        delta = r + gamma * jnp.where(follows, next_v, 0.0) - v
        a = delta + gamma * lam * jnp.where(follows, next_a, 0.0)
        carry = (jnp.where(trained, v, next_v), jnp.where(trained, a, next_a),
                 jnp.where(trained, seg, next_seg))
        return carry, jnp.where(trained, a, 0.0)

    B = mask_BxT.shape[0]
    start = (jnp.zeros((B,), jnp.float32), jnp.zeros((B,), jnp.float32),
             jnp.full((B,), -1, jnp.int32))      # -1: no segment id, nothing follows
    xs = (reward_BxT.astype(jnp.float32).T, values_BxT.T, trained_BxT.T, seg_BxT.T)
    _, adv_TxB = jax.lax.scan(back, start, xs, reverse=True)
    adv_BxT = adv_TxB.T
    return adv_BxT, jnp.where(trained_BxT, adv_BxT + values_BxT, 0.0)


def with_gae(batch: Batch, values_BxT: jnp.ndarray, *, gamma: float, lam: float
             ) -> tuple[dict, Metrics]:
    """The batch with GAE advantages (`adv_BxT`), value targets (`returns_BxT`) and the
    pre-update values (`old_values_BxT`), from the critic's values and `reward_BxT`."""
    if "reward_BxT" not in batch:
        raise ValueError("GAE needs the batch's per-token rewards (reward_BxT); "
                         "fnrl.trainer.batching adds them when algo.advantage == 'gae'")
    old = _sg(values_BxT.astype(jnp.float32))
    adv, returns = gae(batch["reward_BxT"], old, batch["mask_BxT"], batch.get("segment_ids_BxT"),
                       gamma=gamma, lam=lam)
    mask = batch["mask_BxT"]
    mean = token_mean(adv, mask)
    metrics = {"adv_mean": mean, "adv_std": jnp.sqrt(token_mean((adv - mean) ** 2, mask)),
               "return_mean": token_mean(returns, mask)}
    return dict(batch, adv_BxT=adv, returns_BxT=returns, old_values_BxT=old), metrics


@register(LOSS_TERMS, "value", needs=("values_BxT",))
def value_loss(logp_BxT: jnp.ndarray, batch: Batch, *, value_clip: float = 0.2
               ) -> tuple[jnp.ndarray, Metrics]:
    """½·(V − R)², or with value_clip = c > 0 PPO's pessimistic clipped form
    ½·max((V − R)², (V_old + clip(V − V_old, −c, c) − R)²), aggregated like the policy
    loss. Its weight in `loss_terms` is the value coefficient (c_1 in PPO)."""
    v, ret, mask = batch["values_BxT"].astype(jnp.float32), batch["returns_BxT"], batch["mask_BxT"]
    err_BxT = (v - ret) ** 2
    metrics = {}
    if value_clip > 0:
        old = batch["old_values_BxT"]
        clipped_BxT = (old + jnp.clip(v - old, -value_clip, value_clip) - ret) ** 2
        metrics["clip_frac"] = token_mean((clipped_BxT > err_BxT).astype(jnp.float32), mask)
        err_BxT = jnp.maximum(err_BxT, clipped_BxT)
    residual_var = token_mean((ret - _sg(v)) ** 2, mask) - token_mean(ret - _sg(v), mask) ** 2
    return_var = token_mean(ret ** 2, mask) - token_mean(ret, mask) ** 2
    metrics.update(value_mean=token_mean(_sg(v), mask),
                   explained_variance=1.0 - residual_var / jnp.maximum(return_var, 1e-8))
    return aggregate(0.5 * err_BxT, batch), metrics


@register(ADVANTAGES, "gae")
def gae_placeholder(rewards_GxN, eps: float = 1e-6):
    """GAE is computed in the train step from the critic's values (`with_gae`); the
    host-side group advantages are zeros, replaced there by the per-token ones."""
    return np.zeros_like(np.asarray(rewards_GxN, np.float32))
