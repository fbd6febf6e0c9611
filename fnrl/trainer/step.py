"""TrainState and the pure, jitted GRPO train step.

The model is a Flax NNX module used only as a definition: `graphdef` is static and
`params` is a plain nested dict of arrays, so optax, Orbax and `jax.jit` all see one
ordinary pytree.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from fnrl.config import AlgoConfig
from fnrl.losses.core import POLICY_LOSSES

Params = Any


@flax.struct.dataclass
class TrainState:
    step: jnp.ndarray          # number of optimizer updates applied = the policy version
    params: Params
    opt_state: optax.OptState


def make_optimizer(algo: AlgoConfig) -> optax.GradientTransformation:
    """AdamW with global-norm clipping; a non-finite gradient skips the update entirely."""
    inner = optax.chain(
        optax.clip_by_global_norm(algo.max_grad_norm),
        optax.adamw(algo.learning_rate, b1=0.9, b2=0.999, weight_decay=algo.weight_decay),
    )
    # apply_if_finite leaves params and moments untouched when loss or grads are NaN/Inf.
    return optax.apply_if_finite(inner, max_consecutive_errors=1_000_000)


def init_state(params: Params, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


def token_logprobs(graphdef: nnx.GraphDef, params: Params, input_BxT: jnp.ndarray,
                   target_BxT: jnp.ndarray) -> jnp.ndarray:
    """log π(target_t | input_≤t) for every position, in float32."""
    logits_BxTxV = nnx.merge(graphdef, params)(input_BxT).astype(jnp.float32)
    logz_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
    picked_BxT = jnp.take_along_axis(logits_BxTxV, target_BxT[..., None], axis=-1)[..., 0]
    return picked_BxT - logz_BxT


def train_step(state: TrainState, batch: Mapping[str, jnp.ndarray], *, graphdef: nnx.GraphDef,
               optimizer: optax.GradientTransformation, loss_fn: Callable) -> tuple[TrainState, dict]:
    """One policy-gradient update on one batch. Pure: jit it once, with donation."""

    def objective(params):
        logp_BxT = token_logprobs(graphdef, params, batch["input_BxT"], batch["target_BxT"])
        loss, metrics = loss_fn(logp_BxT, batch)
        return loss, metrics

    (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    finite = jnp.isfinite(loss) & jnp.all(jnp.array(
        [jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    new_state = dataclasses.replace(
        state, step=state.step + finite.astype(jnp.int32), params=params, opt_state=opt_state)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads),
                   update_skipped=1.0 - finite.astype(jnp.float32))
    return new_state, metrics


def compile_train_step(graphdef, optimizer, algo: AlgoConfig, state_sharding, batch_sharding):
    """jax.jit with explicit shardings and the old state donated."""
    loss_fn = functools.partial(POLICY_LOSSES["grpo"], clip_low=algo.clip_low,
                                clip_high=algo.clip_high)
    step = functools.partial(train_step, graphdef=graphdef, optimizer=optimizer, loss_fn=loss_fn)
    return jax.jit(step, in_shardings=(state_sharding, batch_sharding),
                   out_shardings=(state_sharding, None), donate_argnums=0)


def sft_step(state: TrainState, batch: Mapping[str, jnp.ndarray], *, graphdef: nnx.GraphDef,
             optimizer: optax.GradientTransformation) -> tuple[TrainState, dict]:
    """Supervised next-token step on masked targets (the warm start)."""

    def objective(params):
        logp_BxT = token_logprobs(graphdef, params, batch["input_BxT"], batch["target_BxT"])
        mask = batch["mask_BxT"]
        return -jnp.sum(logp_BxT * mask) / jnp.maximum(mask.sum(), 1.0)

    loss, grads = jax.value_and_grad(objective)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return dataclasses.replace(state, step=state.step + 1, params=params, opt_state=opt_state), {
        "loss": loss}


def pack_sequences(prompts: list[tuple[int, ...]], responses: list[tuple[int, ...]], seq_len: int,
                   pad_id: int) -> dict[str, np.ndarray]:
    """Right-padded next-token arrays: input/target of length seq_len and a response mask.

    Position t predicts target t = token t+1; the mask is 1 where the target is a
    response token, so per-token response arrays start at index len(prompt) - 1.
    """
    b = len(prompts)
    tokens = np.full((b, seq_len + 1), pad_id, np.int32)
    mask = np.zeros((b, seq_len), np.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        n = len(p) + len(r)
        if n > seq_len + 1:
            raise ValueError(f"sequence {i} has {n} tokens; the step's length is {seq_len + 1}")
        tokens[i, :n] = p + r
        mask[i, len(p) - 1:n - 1] = 1.0
    return {"input_BxT": tokens[:, :-1], "target_BxT": tokens[:, 1:], "mask_BxT": mask}


def scatter_response(values: list[tuple[float, ...]], prompt_lens: list[int], seq_len: int,
                     dtype=np.float32) -> np.ndarray:
    """Places per-response-token values at the positions `pack_sequences` masks."""
    out = np.zeros((len(values), seq_len), dtype)
    for i, (v, plen) in enumerate(zip(values, prompt_lens)):
        out[i, plen - 1:plen - 1 + len(v)] = v
    return out
