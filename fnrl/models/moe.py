"""The mixture-of-experts feed-forward of Qwen3-MoE, numerically matching Hugging Face.

Per token, a router (E×X, no bias) scores the X experts; softmax over them in float32;
the top K (`num_experts_per_tok`) are kept, renormalised to sum to 1 when
`norm_topk_prob`; the token's output is the weighted sum of those K SwiGLU experts
(transformers' Qwen3MoeSparseMoeBlock). The block's params, beside a layer's attention:

    'moe': {'router_kernel': E×X,
            'gate_kernel': X×E×I, 'up_kernel': X×E×I, 'down_kernel': X×I×E}

with I = `moe_intermediate_size` and logical axes ("embed", "expert") for the router,
("expert", "embed", "mlp") and ("expert", "mlp", "embed") for the experts.

**Dispatch** (`expert_ffn`): the N·K (token, expert) assignments are sorted by expert,
the tokens gathered in that order, and each expert's contiguous run multiplied by its
own kernels with `jax.lax.ragged_dot` (group sizes = tokens per expert). Chosen over
the alternatives because it does exactly the routed work, N·K token-expert products,
with no capacity: a capacity-factor dispatch (Switch, GShard) drops the tokens that
overflow an expert, so the trainer's forward would differ from the inference engine's
for exactly the tokens RL scores, and a dense loop over all experts does X/K times the
work. `ragged_dot` is one primitive with one call site on every backend, works under
jit, grad and sharding (tests/models/test_moe.py), and has static shapes: N·K rows
whatever the routing. How fast it runs is the backend's: on CPU JAX lowers it to a
masked dense product (X times the FLOPs and an X×N·K×E masked copy: fine for tests'
tiny models, the CPU twin, not for real ones); on GPU to XLA's ragged-dot instruction,
which recent XLA gives cuDNN's grouped GEMM and older XLA rewrites to a dense dot, or,
with `jax_ragged_dot_use_gpu_pallas_triton_lowering`, to a Pallas Triton grouped GEMM.
Which of these this jaxlib does on a GPU is for the GPU lane to measure.

**Routing replay**: `routes_NxK`, when given, are the experts an inference engine chose
(vLLM's `routed_experts`); they replace the router's top K, so the trainer computes
the very function that sampled the tokens. Their weights are the trainer's own router
probabilities at those ids (renormalised when `norm_topk_prob`), so the router still
gets gradients. Ids must be distinct per token and in [0, X): they are data inside jit
and are not checked there.

**Router statistics** (`layer_stats`, `reduce_layer_stats`): the Switch/Qwen
load-balancing loss exactly as transformers' `load_balancing_loss_func`, and, under
replay, how often the replayed experts are not among the router's own top K.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from fnrl.models.families import DecoderConfig

__all__ = ["EXPERT_OUTS", "MoeBlock", "expert_ffn", "layer_stats", "reduce_layer_stats",
           "route"]

EXPERT_OUTS = ("moe_gate_up", "moe_down")
"""Names the two expert matmul outputs carry (`checkpoint_name`): the "dots" remat
policy saves them, as it saves every weight matmul; `ragged_dot` is not a dot_general,
so the policy's dot rule alone would recompute both in the backward pass."""


def route(probs_NxX: jax.Array, k: int, norm_topk_prob: bool,
          routes_NxK: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(expert ids N×K int32, float32 weights N×K): the router's top k of float32
    `probs_NxX` or, when given, the replayed `routes_NxK`, weighted by their
    probabilities, renormalised to sum to 1 when `norm_topk_prob` (HF Qwen3-MoE)."""
    if routes_NxK is None:
        weights_NxK, ids_NxK = jax.lax.top_k(probs_NxX, k)
    else:
        ids_NxK = routes_NxK.astype(jnp.int32)
        weights_NxK = jnp.take_along_axis(probs_NxX, ids_NxK, axis=-1)
    if norm_topk_prob:
        weights_NxK = weights_NxK / jnp.sum(weights_NxK, axis=-1, keepdims=True)
    return ids_NxK.astype(jnp.int32), weights_NxK


def expert_ffn(x_NxE: jax.Array, ids_NxK: jax.Array, weights_NxK: jax.Array,
               gate_XxExI: jax.Array, up_XxExI: jax.Array, down_XxIxE: jax.Array) -> jax.Array:
    """Σ_k weights[n, k] · expert_{ids[n, k]}(x[n]) for SwiGLU experts, by sorting the
    N·K assignments by expert and one `ragged_dot` per matmul (see the module
    docstring); computed in x's dtype, kernels cast to it."""
    N, E = x_NxE.shape
    K = ids_NxK.shape[1]
    X, _, I = gate_XxExI.shape
    dtype = x_NxE.dtype
    expert_A = ids_NxK.reshape(-1)  # A = N·K assignments, token-major
    order_A = jnp.argsort(expert_A, stable=True)
    group_sizes_X = jnp.bincount(expert_A, length=X).astype(jnp.int32)
    x_AxE = x_NxE[order_A // K]
    # gate and up as one ragged matmul, as MLP fuses them into one dot.
    gate_up_XxEx2I = jnp.concatenate([gate_XxExI, up_XxExI], axis=-1).astype(dtype)
    gate_up_Ax2I = checkpoint_name(jax.lax.ragged_dot(x_AxE, gate_up_XxEx2I, group_sizes_X),
                                   EXPERT_OUTS[0])
    gate_AxI, up_AxI = jnp.split(gate_up_Ax2I, [I], axis=1)
    out_AxE = checkpoint_name(jax.lax.ragged_dot(jax.nn.silu(gate_AxI) * up_AxI,
                                                 down_XxIxE.astype(dtype), group_sizes_X),
                              EXPERT_OUTS[1])
    # Back to token-major order by a gather (its inverse permutation), then a weighted
    # sum over k: no scatter-add, whose order of accumulation is not fixed on GPU.
    position_A = jnp.zeros_like(order_A).at[order_A].set(jnp.arange(N * K, dtype=order_A.dtype))
    out_NxKxE = out_AxE[position_A].reshape(N, K, E)
    return jnp.einsum("nke,nk->ne", out_NxKxE, weights_NxK.astype(dtype))


def layer_stats(probs_NxX: jax.Array, own_NxK: jax.Array, routes_NxK: jax.Array | None,
                mask_N: jax.Array | None) -> dict[str, jax.Array]:
    """One layer's router statistics over the tokens `mask_N` keeps (all when None):

    tokens_per_expert_X  fraction of tokens with the expert in the router's own top K
                         (sums to K), f_e of the load-balancing loss
    prob_per_expert_X    mean router probability, P_e of the loss
    route_disagreement   fraction of the replayed (token, k) routes whose expert is not
                         among the router's own top K `own_NxK` (0 without replay)

    f counts the router's own top K even under replay, as transformers computes the
    loss from the router logits alone; its gradient flows through P only.
    """
    N, X = probs_NxX.shape
    m_N = jnp.ones((N,), jnp.float32) if mask_N is None else mask_N.astype(jnp.float32)
    # max(.., 1): a batch of padding only gives zeros, not NaN.
    count = jnp.maximum(jnp.sum(m_N), 1.0)
    chosen_NxX = jnp.sum(jax.nn.one_hot(own_NxK, X, dtype=jnp.float32), axis=1)
    stats = {"tokens_per_expert_X": m_N @ chosen_NxX / count,
             "prob_per_expert_X": m_N @ probs_NxX.astype(jnp.float32) / count}
    if routes_NxK is None:
        stats["route_disagreement"] = jnp.zeros((), jnp.float32)
    else:  # a set comparison per token: the order of the K ids does not matter
        outside_NxK = ~jnp.any(routes_NxK[:, :, None] == own_NxK[:, None, :], axis=-1)
        stats["route_disagreement"] = m_N @ jnp.mean(outside_NxK, axis=1, dtype=jnp.float32) / count
    return stats


def reduce_layer_stats(stats_L: Mapping[str, jax.Array], num_experts: int
                       ) -> dict[str, jax.Array]:
    """{"aux_loss", "route_disagreement"} (float32 scalars) from `layer_stats` stacked
    over L layers; zeros for a dense model (empty `stats_L`).

    aux_loss = X · Σ_e f̄_e · P̄_e with f and P averaged over layers first, as
    transformers pools every layer's router logits before the product (its
    `load_balancing_loss_func`): not the mean of per-layer losses. Unscaled:
    `router_aux_loss_coef` is the caller's to apply.
    """
    if not stats_L:
        zero = jnp.zeros((), jnp.float32)
        return {"aux_loss": zero, "route_disagreement": zero}
    f_X = jnp.mean(stats_L["tokens_per_expert_X"], axis=0)
    p_X = jnp.mean(stats_L["prob_per_expert_X"], axis=0)
    return {"aux_loss": num_experts * jnp.sum(f_X * p_X),
            "route_disagreement": jnp.mean(stats_L["route_disagreement"])}


class MoeBlock(nnx.Module):
    """Qwen3-MoE's sparse MLP: router, top-k (or replayed) experts, weighted SwiGLUs.

    `param(shape, axes)` makes one normally initialised `nnx.Param` (the decoder's
    factory, so every parameter is born alike).
    """

    def __init__(self, cfg: DecoderConfig, *, param: Callable[[tuple, tuple], nnx.Param],
                 dtype):
        E, X, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.router_kernel = param((E, X), ("embed", "expert"))
        self.gate_kernel = param((X, E, I), ("expert", "embed", "mlp"))
        self.up_kernel = param((X, E, I), ("expert", "embed", "mlp"))
        self.down_kernel = param((X, I, E), ("expert", "mlp", "embed"))
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.dtype = dtype

    def __call__(self, x_BxTxE, routes_BxTxK=None, mask_BxT=None):
        """(y B×T×E, stats): `layer_stats` and "routes_BxTxK", the router's own top K.
        `routes_BxTxK` replays an engine's experts; `mask_BxT` (1: a real token) limits
        the statistics, never the output."""
        B, T, E = x_BxTxE.shape
        x_NxE = x_BxTxE.reshape(B * T, E)
        # Logits rounded to the compute dtype, then a float32 softmax: HF's and vLLM's
        # order, so bfloat16 routing ties break as the engine's do.
        logits_NxX = (x_NxE @ self.router_kernel[...].astype(self.dtype)).astype(jnp.float32)
        probs_NxX = jax.nn.softmax(logits_NxX, axis=-1)
        routes_NxK = None if routes_BxTxK is None else routes_BxTxK.reshape(B * T, -1)
        own_NxK, weights_NxK = route(probs_NxX, self.top_k, self.norm_topk_prob)
        ids_NxK = own_NxK
        if routes_NxK is not None:
            ids_NxK, weights_NxK = route(probs_NxX, self.top_k, self.norm_topk_prob, routes_NxK)
        y_NxE = expert_ffn(x_NxE, ids_NxK, weights_NxK, self.gate_kernel[...],
                           self.up_kernel[...], self.down_kernel[...])
        mask_N = None if mask_BxT is None else mask_BxT.reshape(B * T)
        stats = layer_stats(probs_NxX, own_NxK, routes_NxK, mask_N)
        stats["routes_BxTxK"] = own_NxK.reshape(B, T, self.top_k)
        return y_NxE.reshape(B, T, E), stats
