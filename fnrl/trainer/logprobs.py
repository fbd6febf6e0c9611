"""Per-token log-probs and entropy from the model's final hidden states, in chunks.

A B×T×V logits array is the largest thing a language-model step can hold: with Qwen's
151,936-token vocabulary, 8 × 1,024 tokens of float32 logits are 5 GB, and the
backward pass wants about as much again. Here the vocabulary projection runs over
chunks of the sequence: each chunk holds the logits of at most `chunk_tokens` tokens
(all B rows × chunk_tokens // B positions), reduces them to one log-prob (and entropy)
per token, and lets them go. Every chunk is wrapped in `jax.checkpoint`, so the
backward pass recomputes its logits from the hidden states instead of storing them:
forward and backward each hold one chunk's logits at a time.

The chunks run along positions, not along flattened B·T, so a chunk keeps the batch
dimension and with it the data-parallel sharding of the rows.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

Params = Any


def _reduce(logits_BxTxV, target_BxT, with_entropy: bool, temperature: float = 1.0):
    """(log p(target), entropy or None) from float32 logits, of softmax(logits / T):
    the distribution vLLM sampled from at temperature T, whose log-probs it returns."""
    if temperature != 1.0:
        logits_BxTxV = logits_BxTxV / temperature
    logz_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
    picked_BxT = jnp.take_along_axis(logits_BxTxV, target_BxT[..., None], axis=-1)[..., 0]
    entropy_BxT = None
    if with_entropy:
        # H = log Z - Σ p·logit, without materialising log p a second time.
        probs_BxTxV = jnp.exp(logits_BxTxV - logz_BxT[..., None])
        entropy_BxT = logz_BxT - jnp.sum(probs_BxTxV * logits_BxTxV, axis=-1)
    return picked_BxT - logz_BxT, entropy_BxT


def _project(h_BxCxE, target_BxC, kernel_VxE, with_entropy: bool, temperature: float = 1.0):
    """One chunk: its logits, accumulated in float32 as Decoder.logits does, reduced.
    The kernel is cast to the hidden states' dtype here, inside the chunk, so each
    chunk's kernel gradient leaves it in the kernel's own dtype and the chunks'
    gradients add up in the parameters' precision (not in bfloat16)."""
    logits_BxCxV = jnp.einsum("bce,ve->bcv", h_BxCxE, kernel_VxE.astype(h_BxCxE.dtype),
                              preferred_element_type=jnp.float32)
    return _reduce(logits_BxCxV, target_BxC, with_entropy, temperature)


def positions_per_chunk(rows: int, length: int, chunk_tokens: int) -> int:
    """Positions per chunk for `chunk_tokens` over `rows` rows (at least 1); `length`
    (one chunk: unchunked) when chunk_tokens is 0 or covers every token."""
    if chunk_tokens <= 0 or chunk_tokens >= rows * length:
        return length
    return max(1, chunk_tokens // rows)


def logprobs_from_hidden(h_BxTxE: jnp.ndarray, target_BxT: jnp.ndarray,
                         kernel_VxE: jnp.ndarray, *, chunk_tokens: int, with_entropy: bool,
                         temperature: float = 1.0) -> tuple[jnp.ndarray, jnp.ndarray | None]:
    """log π(target_t) (and per-token entropy if asked) for every position, float32.

    `kernel_VxE` is the model's output projection, best in its storage dtype (cast to
    h's in each chunk).
    chunk_tokens = 0 projects all tokens at once; otherwise at most chunk_tokens
    tokens' logits exist at a time, in the forward and in the backward pass (each
    chunk is rematerialised).
    """
    B, T, E = h_BxTxE.shape
    c = positions_per_chunk(B, T, chunk_tokens)
    if c == T:
        return _project(h_BxTxE, target_BxT, kernel_VxE, with_entropy, temperature)
    n = -(-T // c)
    pad = n * c - T   # the padded positions compute a throwaway log-prob of token 0
    h_NxBxCxE = jnp.pad(h_BxTxE, ((0, 0), (0, pad), (0, 0))).reshape(B, n, c, E).swapaxes(0, 1)
    t_NxBxC = jnp.pad(target_BxT, ((0, 0), (0, pad))).reshape(B, n, c).swapaxes(0, 1)

    @jax.checkpoint
    def chunk(args):
        logp_BxC, entropy_BxC = _project(*args, kernel_VxE, with_entropy, temperature)
        return logp_BxC, (entropy_BxC if with_entropy else jnp.zeros_like(logp_BxC))

    logp_NxBxC, entropy_NxBxC = jax.lax.map(chunk, (h_NxBxCxE, t_NxBxC))
    unchunk = lambda x: x.swapaxes(0, 1).reshape(B, n * c)[:, :T]  # noqa: E731
    return unchunk(logp_NxBxC), (unchunk(entropy_NxBxC) if with_entropy else None)


def _hidden_and_kernel(graphdef: nnx.GraphDef, params: Params, input_BxT, positions_BxT,
                       segment_ids_BxT):
    model = nnx.merge(graphdef, params)
    h_BxTxE = model.hidden_states(input_BxT, positions_BxT, segment_ids_BxT)
    # Decoder.vocab_kernel_VxE in the storage dtype: cast per chunk (see _project).
    kernel_VxE = model.embedding[...] if model.lm_head is None else model.lm_head[...].T
    return h_BxTxE, kernel_VxE


def model_logprobs(graphdef: nnx.GraphDef, params: Params, input_BxT, target_BxT,
                   positions_BxT=None, segment_ids_BxT=None, *, chunk_tokens: int = 0,
                   with_entropy: bool = False, temperature: float = 1.0
                   ) -> tuple[jnp.ndarray, jnp.ndarray | None]:
    """(log-probs of the targets, per-token entropy or None) of softmax(logits /
    temperature), float32.

    chunk_tokens = 0 takes the model's own full logits; > 0 projects its final hidden
    states chunk by chunk (`logprobs_from_hidden`), never holding B×T×V logits.
    """
    if chunk_tokens <= 0:
        model = nnx.merge(graphdef, params)
        logits_BxTxV = model(input_BxT, positions_BxT, segment_ids_BxT).astype(jnp.float32)
        return _reduce(logits_BxTxV, target_BxT, with_entropy, temperature)
    h_BxTxE, kernel_VxE = _hidden_and_kernel(graphdef, params, input_BxT, positions_BxT,
                                             segment_ids_BxT)
    return logprobs_from_hidden(h_BxTxE, target_BxT, kernel_VxE,
                                chunk_tokens=chunk_tokens, with_entropy=with_entropy,
                                temperature=temperature)


def value_head_init(hidden_size: int) -> Params:
    """A value head V(h) = w·h + b, float32, at zero: the critic starts by predicting 0."""
    return {"kernel_E": jnp.zeros((hidden_size,), jnp.float32), "bias": jnp.zeros((), jnp.float32)}


def model_logprobs_and_values(graphdef: nnx.GraphDef, params: Params, value_head: Params,
                              input_BxT, target_BxT, positions_BxT=None, segment_ids_BxT=None, *,
                              chunk_tokens: int = 0, with_entropy: bool = False,
                              temperature: float = 1.0, trunk_grad: bool = False
                              ) -> tuple[jnp.ndarray, jnp.ndarray | None, jnp.ndarray]:
    """`model_logprobs`, and the value head's V at every position (float32, B×T), from
    one pass of the trunk. Position t's V is that of the state before target t, as its
    log-prob is. Without `trunk_grad` the value's gradient stops at the hidden states,
    so only the head learns from it (fnrl.losses.value)."""
    h_BxTxE, kernel_VxE = _hidden_and_kernel(graphdef, params, input_BxT, positions_BxT,
                                             segment_ids_BxT)
    logp_BxT, entropy_BxT = logprobs_from_hidden(
        h_BxTxE, target_BxT, kernel_VxE, chunk_tokens=chunk_tokens, with_entropy=with_entropy,
        temperature=temperature)
    h_value = h_BxTxE if trunk_grad else jax.lax.stop_gradient(h_BxTxE)
    # In float32 whatever the compute dtype: the head is tiny, its targets are not.
    values_BxT = jnp.einsum("bte,e->bt", h_value.astype(jnp.float32),
                            value_head["kernel_E"]) + value_head["bias"]
    return logp_BxT, entropy_BxT, values_BxT
