"""How per-token losses are reduced to one number, as per-token weights.

Each mode maps the batch's response mask to weights w_BxT, and a term's loss is
Σ_t x_t·w_t. Computing the weights once on the whole batch (before any split into
micro-batches) makes gradient accumulation exact, and the modes differ only here:

  token_mean            1 / (all response tokens)                        DAPO
  seq_mean_token_mean   1 / (num sequences · tokens of this sequence)    GRPO paper
  seq_mean_token_sum    1 / num sequences
  constant              1 / (num sequences · norm_len)                  Dr.GRPO

Sequences with no response token (invalid trajectories) do not count.
Tokens that a mismatch correction masks later keep their weight slot, so masking
lowers the loss scale instead of up-weighting the surviving tokens.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from fnrl.losses.core import Batch, sequence_ids

AGGREGATIONS: dict[str, Callable[..., jnp.ndarray]] = {}


def _mode(name: str):
    def wrap(fn):
        AGGREGATIONS[name] = fn
        return fn
    return wrap


def _num_sequences(batch: Batch) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(number of sequences with ≥1 response token, each token's sequence length)."""
    seq_BxT, n = sequence_ids(batch)
    mask = batch["mask_BxT"]
    lens_S = jax.ops.segment_sum(mask.reshape(-1), seq_BxT.reshape(-1), n)
    return jnp.maximum(jnp.sum(lens_S > 0), 1).astype(jnp.float32), lens_S[seq_BxT]


@_mode("token_mean")
def token_mean_weights(batch: Batch, norm_len: int = 0) -> jnp.ndarray:
    mask = batch["mask_BxT"]
    return mask / jnp.maximum(jnp.sum(mask), 1.0)


@_mode("seq_mean_token_mean")
def seq_mean_token_mean_weights(batch: Batch, norm_len: int = 0) -> jnp.ndarray:
    num_seqs, lens_BxT = _num_sequences(batch)
    return batch["mask_BxT"] / (num_seqs * jnp.maximum(lens_BxT, 1.0))


@_mode("seq_mean_token_sum")
def seq_mean_token_sum_weights(batch: Batch, norm_len: int = 0) -> jnp.ndarray:
    num_seqs, _ = _num_sequences(batch)
    return batch["mask_BxT"] / num_seqs


@_mode("constant")
def constant_weights(batch: Batch, norm_len: int = 0) -> jnp.ndarray:
    # Dr.GRPO: a normalizer that does not depend on response length, so long wrong
    # answers are not penalised less per token than short ones.
    num_seqs, _ = _num_sequences(batch)
    length = norm_len if norm_len > 0 else batch["mask_BxT"].shape[1]
    return batch["mask_BxT"] / (num_seqs * length)


def with_weights(batch: Batch, mode: str = "token_mean", norm_len: int = 0) -> dict:
    """The batch with `weight_BxT` set for aggregation `mode`."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; known: {sorted(AGGREGATIONS)}")
    return dict(batch, weight_BxT=AGGREGATIONS[mode](batch, norm_len))
