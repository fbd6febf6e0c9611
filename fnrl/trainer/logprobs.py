"""Per-token log-probs and entropy from the model's final hidden states, in chunks.

A B×T×V logits array is the largest thing a language-model step can hold: with Qwen's
151,936-token vocabulary, 8 × 1,024 tokens of float32 logits are 5 GB, and the
backward pass wants about as much again. Here the vocabulary projection runs over
chunks of the sequence, fused with its reductions under a hand-written VJP
(`_fused_logprobs`): the forward pass keeps one log-sum-exp (and entropy) per token and
lets each chunk's logits go; the backward pass recomputes a chunk's logits, turns them
straight into their cotangent and folds that into the hidden states' gradient and a
float32 kernel gradient carried across chunks. Forward and backward each hold one
chunk's logits at a time, and autodiff never sees them.

The chunks run along positions, not along flattened B·T, so a chunk keeps the batch
dimension and with it the data-parallel sharding of the rows. chunk_tokens = 0 keeps
the plain autodiff path over the full logits: the reference the fused one is tested on.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

Params = Any


def support_threshold(z_BxTxV, top_k: int = -1, top_p: float = 1.0):
    """The smallest z a token may have and still be in the sampler's support, B×T, or
    None when nothing is truncated: vLLM's top-k then top-p (vllm.v1.sample.ops.
    topk_topp_sampler, over z = logits / temperature), whose `processed_logprobs` are
    those of the renormalised distribution on that support. Constant (no gradient): the
    support is where the sample came from, not something the loss moves.

    top-k keeps every z at least the k-th largest (ties kept); top-p then drops, in
    ascending order, tokens whose cumulative probability is at most 1 - p, and never the
    largest."""
    if top_k <= 0 and top_p >= 1.0:
        return None
    z_BxTxV = jax.lax.stop_gradient(z_BxTxV)
    V = z_BxTxV.shape[-1]
    if top_p >= 1.0:   # top-k alone: no sort of the whole vocabulary
        return jax.lax.top_k(z_BxTxV, min(top_k, V))[0][..., -1]
    sorted_BxTxV = jnp.sort(z_BxTxV, axis=-1)   # ascending, as vLLM sorts
    if top_k > 0:
        kth_BxT = sorted_BxTxV[..., V - min(top_k, V)]
        sorted_BxTxV = jnp.where(sorted_BxTxV < kth_BxT[..., None], -jnp.inf, sorted_BxTxV)
    cumulative_BxTxV = jnp.cumsum(jax.nn.softmax(sorted_BxTxV, axis=-1), axis=-1)
    dropped_BxTxV = (cumulative_BxTxV <= 1.0 - top_p).at[..., -1].set(False)
    kept_BxTxV = jnp.where(dropped_BxTxV, jnp.inf, sorted_BxTxV)
    return jnp.min(kept_BxTxV, axis=-1)


def _kept(z_BxTxV, target_BxT, threshold_BxT):
    """The support as booleans; the sampled token always in it (it was sampled: only
    rounding at the boundary could put it out, and its log-prob would be -inf)."""
    V = z_BxTxV.shape[-1]
    return ((z_BxTxV >= threshold_BxT[..., None])
            | (jnp.arange(V) == target_BxT[..., None]))


def _softmax_stats(z_BxTxV, target_BxT, with_entropy: bool, threshold_BxT=None):
    """(log p(target), log Z, entropy or None) of softmax(z) on the support (all of the
    vocabulary when `threshold_BxT` is None, else z ≥ threshold), z float32."""
    picked_BxT = jnp.take_along_axis(z_BxTxV, target_BxT[..., None], axis=-1)[..., 0]
    support_z_BxTxV = z_BxTxV   # -inf off the support (for log Z); z is 0 there (Σ p·z)
    if threshold_BxT is not None:
        kept_BxTxV = _kept(z_BxTxV, target_BxT, threshold_BxT)
        support_z_BxTxV = jnp.where(kept_BxTxV, z_BxTxV, -jnp.inf)
        z_BxTxV = jnp.where(kept_BxTxV, z_BxTxV, 0.0)   # no 0·-inf, in value or gradient
    logz_BxT = jax.nn.logsumexp(support_z_BxTxV, axis=-1)
    entropy_BxT = None
    if with_entropy:
        # H = log Z - Σ p·z, without materialising log p a second time.
        probs_BxTxV = jnp.exp(support_z_BxTxV - logz_BxT[..., None])
        entropy_BxT = logz_BxT - jnp.sum(probs_BxTxV * z_BxTxV, axis=-1)
    return picked_BxT - logz_BxT, logz_BxT, entropy_BxT


def _reduce(logits_BxTxV, target_BxT, with_entropy: bool, temperature: float = 1.0,
            top_k: int = -1, top_p: float = 1.0):
    """(log p(target), entropy or None) from float32 logits, of softmax(logits / T) on
    the top-k/top-p support: the distribution vLLM sampled from, whose log-probs it
    returns (`support_threshold`)."""
    z_BxTxV = logits_BxTxV / temperature
    logp_BxT, _, entropy_BxT = _softmax_stats(
        z_BxTxV, target_BxT, with_entropy, support_threshold(z_BxTxV, top_k, top_p))
    return logp_BxT, entropy_BxT


def _logits(h_BxCxE, kernel_VxE):
    """A chunk's logits, accumulated in float32 as Decoder.logits does. The kernel is
    cast to the hidden states' dtype here, inside the chunk, so a bfloat16 trunk
    multiplies in bfloat16 whatever the parameters' storage dtype."""
    return jnp.einsum("bce,ve->bcv", h_BxCxE, kernel_VxE.astype(h_BxCxE.dtype),
                      preferred_element_type=jnp.float32)


def _project(h_BxCxE, target_BxC, kernel_VxE, with_entropy: bool, temperature: float = 1.0,
             top_k: int = -1, top_p: float = 1.0):
    """All positions at once through autodiff: the reference path (chunk_tokens = 0)."""
    return _reduce(_logits(h_BxCxE, kernel_VxE), target_BxC, with_entropy, temperature,
                   top_k, top_p)


# with_entropy, temperature, top_k and top_p are static; the targets are integers and get
# no gradient.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _fused_logprobs(with_entropy: bool, temperature: float, top_k: int, top_p: float,
                    h_NxBxCxE, target_NxBxC, kernel_VxE):
    """(log p(target), entropy or None), each N×B×C float32, over N chunks of C
    positions, holding one chunk's B×C×V logits at a time."""
    return _fused_forward(with_entropy, temperature, top_k, top_p, h_NxBxCxE, target_NxBxC,
                          kernel_VxE)[0]


def _fused_forward(with_entropy, temperature, top_k, top_p, h_NxBxCxE, target_NxBxC,
                   kernel_VxE):
    # Cast once, outside the loop: inside it every chunk would convert the whole V×E.
    kernel_c_VxE = kernel_VxE.astype(h_NxBxCxE.dtype)

    def chunk(args):
        h_BxCxE, target_BxC = args
        z_BxCxV = _logits(h_BxCxE, kernel_c_VxE) / temperature
        threshold_BxC = support_threshold(z_BxCxV, top_k, top_p)
        stats = _softmax_stats(z_BxCxV, target_BxC, with_entropy, threshold_BxC)
        return stats + (threshold_BxC,)

    logp_NxBxC, logz_NxBxC, entropy_NxBxC, threshold_NxBxC = jax.lax.map(
        chunk, (h_NxBxCxE, target_NxBxC))
    # The residuals are the inputs, one log Z and one support threshold per token:
    # never the logits.
    return (logp_NxBxC, entropy_NxBxC), (h_NxBxCxE, target_NxBxC, kernel_VxE, logz_NxBxC,
                                         threshold_NxBxC)


def _fused_backward(with_entropy, temperature, top_k, top_p, residuals, cotangents):
    h_NxBxCxE, target_NxBxC, kernel_VxE, logz_NxBxC, threshold_NxBxC = residuals
    g_logp_NxBxC, g_entropy_NxBxC = cotangents
    V = kernel_VxE.shape[0]
    kernel_c_VxE = kernel_VxE.astype(h_NxBxCxE.dtype)   # once, as in the forward pass

    def chunk(dkernel_VxE, args):
        h_BxCxE, target_BxC, logz_BxC, g_logp_BxC, g_entropy_BxC, threshold_BxC = args
        z_BxCxV = _logits(h_BxCxE, kernel_c_VxE) / temperature
        p_BxCxV = jnp.exp(z_BxCxV - logz_BxC[..., None])
        if threshold_BxC is not None:   # p is 0 off the support, and so is its gradient
            kept_BxCxV = _kept(z_BxCxV, target_BxC, threshold_BxC)
            p_BxCxV = jnp.where(kept_BxCxV, p_BxCxV, 0.0)
            z_BxCxV = jnp.where(kept_BxCxV, z_BxCxV, 0.0)
        # d log p(t)/dz = onehot(t) - p, and d H/dz = -p·(z - Σ p·z): Σ p·z is summed
        # again here rather than taken as log Z - H, whose cancellation costs digits.
        scale_BxCxV = g_logp_BxC[..., None]
        if with_entropy:
            mean_z_BxC = jnp.sum(p_BxCxV * z_BxCxV, axis=-1)
            scale_BxCxV = scale_BxCxV + g_entropy_BxC[..., None] * (
                z_BxCxV - mean_z_BxC[..., None])
        onehot_BxCxV = jax.nn.one_hot(target_BxC, V, dtype=jnp.float32)
        dz_BxCxV = onehot_BxCxV * g_logp_BxC[..., None] - p_BxCxV * scale_BxCxV
        # In the trunk's dtype for the two matmuls, as autodiff of _project would be
        # (bfloat16 tensor cores on a bfloat16 trunk), accumulated in float32.
        dlogits_BxCxV = (dz_BxCxV / temperature).astype(h_BxCxE.dtype)
        dh_BxCxE = jnp.einsum("bcv,ve->bce", dlogits_BxCxV, kernel_c_VxE,
                              preferred_element_type=jnp.float32).astype(h_BxCxE.dtype)
        dkernel_VxE = dkernel_VxE + jnp.einsum("bcv,bce->ve", dlogits_BxCxV, h_BxCxE,
                                               preferred_element_type=jnp.float32)
        return dkernel_VxE, dh_BxCxE

    g_entropy_NxBxC = g_entropy_NxBxC if with_entropy else jnp.zeros_like(g_logp_NxBxC)
    xs = (h_NxBxCxE, target_NxBxC, logz_NxBxC, g_logp_NxBxC, g_entropy_NxBxC,
          threshold_NxBxC)
    # The kernel's gradient sums over every chunk in float32, whatever its own dtype.
    dkernel_VxE, dh_NxBxCxE = jax.lax.scan(
        chunk, jnp.zeros_like(kernel_VxE, dtype=jnp.float32), xs)
    return dh_NxBxCxE, None, dkernel_VxE.astype(kernel_VxE.dtype)


_fused_logprobs.defvjp(_fused_forward, _fused_backward)


def positions_per_chunk(rows: int, length: int, chunk_tokens: int) -> int:
    """Positions per chunk for `chunk_tokens` over `rows` rows (at least 1); `length`
    (one chunk: unchunked) when chunk_tokens is 0 or covers every token."""
    if chunk_tokens <= 0 or chunk_tokens >= rows * length:
        return length
    return max(1, chunk_tokens // rows)


def logprobs_from_hidden(h_BxTxE: jnp.ndarray, target_BxT: jnp.ndarray,
                         kernel_VxE: jnp.ndarray, *, chunk_tokens: int, with_entropy: bool,
                         temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0
                         ) -> tuple[jnp.ndarray, jnp.ndarray | None]:
    """log π(target_t) (and per-token entropy if asked) for every position, float32.

    `kernel_VxE` is the model's output projection, best in its storage dtype (cast to
    h's in each chunk; its gradient comes back in its own dtype, summed in float32).
    chunk_tokens > 0 (the fused path) holds at most chunk_tokens tokens' logits at a
    time, in the forward and the backward pass; chunk_tokens = 0 projects all tokens
    at once through autodiff, the reference for parity tests. π is softmax(logits / T)
    on the sampler's top-k/top-p support (`support_threshold`).
    """
    if chunk_tokens <= 0:
        return _project(h_BxTxE, target_BxT, kernel_VxE, with_entropy, temperature, top_k,
                        top_p)
    B, T, E = h_BxTxE.shape
    c = positions_per_chunk(B, T, chunk_tokens)
    n = -(-T // c)
    pad = n * c - T   # the padded positions compute a throwaway log-prob of token 0
    h_NxBxCxE = jnp.pad(h_BxTxE, ((0, 0), (0, pad), (0, 0))).reshape(B, n, c, E).swapaxes(0, 1)
    t_NxBxC = jnp.pad(target_BxT, ((0, 0), (0, pad))).reshape(B, n, c).swapaxes(0, 1)
    logp_NxBxC, entropy_NxBxC = _fused_logprobs(with_entropy, float(temperature), int(top_k),
                                                float(top_p), h_NxBxCxE, t_NxBxC, kernel_VxE)
    unchunk = lambda x: x.swapaxes(0, 1).reshape(B, n * c)[:, :T]  # noqa: E731
    return unchunk(logp_NxBxC), (unchunk(entropy_NxBxC) if with_entropy else None)


def _hidden_and_kernel(graphdef: nnx.GraphDef, params: Params, input_BxT, positions_BxT,
                       segment_ids_BxT):
    model = nnx.merge(graphdef, params)
    h_BxTxE = model.hidden_states(input_BxT, positions_BxT, segment_ids_BxT)
    return h_BxTxE, _stored_vocab_kernel(model)


def _stored_vocab_kernel(model) -> jnp.ndarray:
    """Decoder.vocab_kernel_VxE in the storage dtype: cast per chunk (see _logits)."""
    return model.embedding[...] if model.lm_head is None else model.lm_head[...].T


def is_moe(params: Params) -> bool:
    """Whether `params` (the whole model's pure dict) route tokens to experts: a layer
    holds a "moe" block in place of "mlp" (fnrl.models.moe)."""
    return any("moe" in layer for layer in params["layers"].values())


def model_logprobs(graphdef: nnx.GraphDef, params: Params, input_BxT, target_BxT,
                   positions_BxT=None, segment_ids_BxT=None, routes_BxTxLxK=None, *,
                   chunk_tokens: int = 0, with_entropy: bool = False, temperature: float = 1.0,
                   top_k: int = -1, top_p: float = 1.0
                   ) -> tuple[jnp.ndarray, jnp.ndarray | None]:
    """(log-probs of the targets, per-token entropy or None) of softmax(logits /
    temperature) on the sampler's top-k/top-p support, float32.

    chunk_tokens = 0 takes the model's own full logits; > 0 projects its final hidden
    states chunk by chunk (`logprobs_from_hidden`), never holding B×T×V logits.
    `routes_BxTxLxK` replays a mixture of experts' routing (None: its own router's).
    """
    logp_BxT, entropy_BxT, _ = model_logprobs_and_router_stats(
        graphdef, params, input_BxT, target_BxT, positions_BxT, segment_ids_BxT,
        routes_BxTxLxK, chunk_tokens=chunk_tokens, with_entropy=with_entropy,
        temperature=temperature, top_k=top_k, top_p=top_p, stats=False)
    return logp_BxT, entropy_BxT


def model_logprobs_and_router_stats(graphdef: nnx.GraphDef, params: Params, input_BxT,
                                    target_BxT, positions_BxT=None, segment_ids_BxT=None,
                                    routes_BxTxLxK=None, *, chunk_tokens: int = 0,
                                    with_entropy: bool = False, temperature: float = 1.0,
                                    top_k: int = -1, top_p: float = 1.0, stats: bool = True):
    """`model_logprobs`, and the router's statistics of the same forward pass
    ({"aux_loss", "route_disagreement"} over the packed rows' tokens, padding left out:
    fnrl.models.moe; zeros for a dense model), or None when `stats` is False."""
    model = nnx.merge(graphdef, params)
    mask_BxT = None if segment_ids_BxT is None else segment_ids_BxT != 0
    if stats:
        h_BxTxE, router = model.hidden_states_with_router_stats(
            input_BxT, positions_BxT, segment_ids_BxT, routes_BxTxLxK, mask_BxT)
    else:
        h_BxTxE = model.hidden_states(input_BxT, positions_BxT, segment_ids_BxT, routes_BxTxLxK)
        router = None
    if chunk_tokens <= 0:
        logits_BxTxV = model.logits(h_BxTxE).astype(jnp.float32)
        return (*_reduce(logits_BxTxV, target_BxT, with_entropy, temperature, top_k, top_p),
                router)
    return (*logprobs_from_hidden(h_BxTxE, target_BxT, _stored_vocab_kernel(model),
                                  chunk_tokens=chunk_tokens, with_entropy=with_entropy,
                                  temperature=temperature, top_k=top_k, top_p=top_p), router)


def value_head_init(hidden_size: int) -> Params:
    """A value head V(h) = w·h + b, float32, at zero: the critic starts by predicting 0."""
    return {"kernel_E": jnp.zeros((hidden_size,), jnp.float32), "bias": jnp.zeros((), jnp.float32)}


def model_logprobs_and_values(graphdef: nnx.GraphDef, params: Params, value_head: Params,
                              input_BxT, target_BxT, positions_BxT=None, segment_ids_BxT=None, *,
                              chunk_tokens: int = 0, with_entropy: bool = False,
                              temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
                              trunk_grad: bool = False
                              ) -> tuple[jnp.ndarray, jnp.ndarray | None, jnp.ndarray]:
    """`model_logprobs`, and the value head's V at every position (float32, B×T), from
    one pass of the trunk. Position t's V is that of the state before target t, as its
    log-prob is. Without `trunk_grad` the value's gradient stops at the hidden states,
    so only the head learns from it (fnrl.losses.value)."""
    h_BxTxE, kernel_VxE = _hidden_and_kernel(graphdef, params, input_BxT, positions_BxT,
                                             segment_ids_BxT)
    logp_BxT, entropy_BxT = logprobs_from_hidden(
        h_BxTxE, target_BxT, kernel_VxE, chunk_tokens=chunk_tokens, with_entropy=with_entropy,
        temperature=temperature, top_k=top_k, top_p=top_p)
    h_value = h_BxTxE if trunk_grad else jax.lax.stop_gradient(h_BxTxE)
    # In float32 whatever the compute dtype: the head is tiny, its targets are not.
    values_BxT = jnp.einsum("bte,e->bt", h_value.astype(jnp.float32),
                            value_head["kernel_E"]) + value_head["bias"]
    return logp_BxT, entropy_BxT, values_BxT
