"""The loss-term contract, the registries, and the helpers every term shares.

A loss term is a pure function

    term(logp_BxT, batch, **hyperparameters) -> (scalar loss, {name: scalar metric})

of the model's new per-token log-probs and an immutable batch (a mapping of arrays
with shape suffixes). It is registered by name in `LOSS_TERMS`, and the config picks
terms and their weights by that name (see `fnrl.losses.objective`).

Keys a term may read (the first four always exist):
  mask_BxT            1.0 on response tokens that are trained, 0.0 elsewhere
  behaviour_logp_BxT  μ: the log-prob vLLM sampled each token with (shipped per token)
  adv_B | adv_BxT     advantage per sequence row, or per token (packed rows, KL reward)
  target_BxT          the sampled token ids
  segment_ids_BxT     packing: which sequence of the row a token belongs to (0 = pad)
  weight_BxT          aggregation weights, set once per step by the trainer (below)
  old_logp_BxT        π_old, the trainer's pre-update log-probs (constant)
  is_weight_BxT       train/inference mismatch correction weight (constant)
  ref_logp_BxT        the frozen reference policy's log-probs (constant)
  entropy_BxT         the model's per-token entropy (differentiable)
  router_aux_loss     a mixture of experts' load-balancing loss, a scalar (differentiable)
"""

from __future__ import annotations

from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from fnrl.config import accept_name

Batch = Mapping[str, jnp.ndarray]
Metrics = dict[str, jnp.ndarray]
LossFn = Callable[..., tuple[jnp.ndarray, Metrics]]

LOSS_TERMS: dict[str, LossFn] = {}
# The historical name: policy losses and the other terms share one registry.
POLICY_LOSSES = LOSS_TERMS
ADVANTAGES: dict[str, Callable[..., np.ndarray]] = {}


def register(table: dict, name: str, *, needs: tuple[str, ...] = ()):
    """Decorator adding `fn` to `table` under `name`.

    `needs` names batch keys the trainer must compute for this term
    ("entropy_BxT", "ref_logp_BxT"); it is stored on the function as `fn.needs`.
    """
    def wrap(fn):
        if name in table:
            raise ValueError(f"{name!r} is already registered")
        if needs:
            fn.needs = tuple(needs)
        table[name] = fn
        # The config validates names without importing the registries (it is a leaf).
        if table is LOSS_TERMS:
            accept_name("loss_terms", name)
        elif table is ADVANTAGES:
            accept_name("advantage", name)
        return fn
    return wrap


def needs_of(fn: Callable) -> tuple[str, ...]:
    """The extra batch keys a term asks for (see `register`)."""
    inner = getattr(fn, "func", fn)  # look through functools.partial
    return tuple(getattr(fn, "needs", ()) or getattr(inner, "needs", ()))


def token_mean(x_BxT: jnp.ndarray, mask_BxT: jnp.ndarray) -> jnp.ndarray:
    """Token-level aggregation (DAPO): every response token in the batch weighs the same."""
    return jnp.sum(x_BxT * mask_BxT) / jnp.maximum(jnp.sum(mask_BxT), 1.0)


def aggregate(x_BxT: jnp.ndarray, batch: Batch) -> jnp.ndarray:
    """Reduces a per-token loss to a scalar with the batch's aggregation weights.

    The trainer sets `weight_BxT` once per step from the whole batch, so a step split
    into micro-batches sums to exactly the same loss; without it, token mean.
    """
    if "weight_BxT" in batch:
        return jnp.sum(x_BxT * batch["weight_BxT"])
    return token_mean(x_BxT, batch["mask_BxT"])


# Log importance ratios are clamped to ±20 before exp. float32 exp overflows at 88.7,
# and inf·0 (a masked token) is NaN, which would skip the whole step; a ratio beyond
# e^20 ≈ 5·10^8 carries no usable signal. The clamp has zero gradient outside, so such
# a token gets no gradient through its ratio (verl clamps at the same bound).
MAX_LOG_RATIO = 20.0


def log_ratio(logp_BxT: jnp.ndarray, anchor_BxT: jnp.ndarray) -> jnp.ndarray:
    """log(π/anchor) per token, clamped to ±MAX_LOG_RATIO."""
    return jnp.clip(logp_BxT - anchor_BxT, -MAX_LOG_RATIO, MAX_LOG_RATIO)


def advantages_BxT(batch: Batch) -> jnp.ndarray:
    """Per-token advantages: `adv_BxT` when present, else `adv_B` broadcast over tokens."""
    if "adv_BxT" in batch:
        return batch["adv_BxT"]
    return batch["adv_B"][:, None]


def sequence_ids(batch: Batch) -> tuple[jnp.ndarray, int]:
    """(seq_BxT, num_segments): an id per token naming its sequence, unique in the batch.

    Unpacked rows are one sequence each. Packed rows hold several: row r, segment s
    gets r*T + s, so ids stay unique inside any slice of rows (micro-batches).
    """
    B, T = batch["mask_BxT"].shape
    rows_BxT = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, T))
    if "segment_ids_BxT" not in batch:
        return rows_BxT, B
    return rows_BxT * T + batch["segment_ids_BxT"].astype(jnp.int32), B * T


def sequence_sum(x_BxT: jnp.ndarray, batch: Batch) -> jnp.ndarray:
    """Σ over each token's own sequence, broadcast back to B×T (masked tokens only)."""
    seq_BxT, n = sequence_ids(batch)
    sums_S = jax.ops.segment_sum((x_BxT * batch["mask_BxT"]).reshape(-1), seq_BxT.reshape(-1), n)
    return sums_S[seq_BxT]


def sequence_mean(x_BxT: jnp.ndarray, batch: Batch) -> jnp.ndarray:
    """Mean over each token's own response tokens, broadcast back to B×T."""
    return sequence_sum(x_BxT, batch) / jnp.maximum(sequence_sum(jnp.ones_like(x_BxT), batch), 1.0)

