"""A decoder-only transformer in Flax NNX (Qwen2, Qwen2.5, Qwen3, Qwen3-MoE, Llama 3), numerically matching Hugging Face.

The module is a definition language only: build it once, split it with
`graphdef, params = nnx.split(model)` and run `forward(graphdef, params, ...)`.
`params` is the pure nested dict `nnx.to_pure_dict(state)`:

    {'embedding': V×E,
     'layers': {i: {'input_norm': {'scale': E},
                    'attn': {'q_kernel': E×H×D, 'q_bias': H×D,     # biases: qwen2 only
                             'k_kernel': E×K×D, 'k_bias': K×D,
                             'v_kernel': E×K×D, 'v_bias': K×D,
                             'q_norm': {'scale': D},               # q/k norms: qwen3 only
                             'k_norm': {'scale': D},
                             'o_kernel': H×D×E},
                    'post_attn_norm': {'scale': E},
                    'mlp': {'gate_kernel': E×I, 'up_kernel': E×I, 'down_kernel': I×E}}},
                    # qwen3_moe: 'moe' in place of 'mlp' (fnrl.models.moe)
     'final_norm': {'scale': E},
     'lm_head': E×V}                      # only when tie_word_embeddings is False

Every parameter carries logical axis names as NNX `out_sharding` metadata;
`logical_axes(cfg)` returns them as a pytree shaped like `params`.

Dtypes: parameters are stored in `param_dtype` and cast to the compute `dtype` where
they are used, so bfloat16 compute over float32 master weights needs no second copy.
Norms, softmax and RoPE run in float32 whatever `dtype` is, and the vocab projection
accumulates in float32.

A mixture-of-experts model takes `routes_BxTxLxK` (every layer's K experts per token, as
the inference engine chose them) to replay that routing, and reports its router
statistics through `forward_with_router_stats` (fnrl.models.moe); a dense model refuses
routes and reports zero statistics.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from fnrl.models.attention import (ATTENTION_OUT, KERNELS, attend, causal_mask,
                                   saves_fused_attention)
from fnrl.config.lora import LoraConfig
from fnrl.models.families import FAMILIES, DecoderConfig, Llama3RopeScaling
from fnrl.models.lora import adapter_a_init, lora_delta
from fnrl.models.moe import EXPERT_OUTS, MoeBlock, reduce_layer_stats

__all__ = ["ATTENTION_BLOCK", "FAMILIES", "Kernels", "REMAT_POLICIES", "remat_policy_name", "Decoder", "DecoderConfig", "Llama3RopeScaling", "abstract_model",
           "forward", "forward_with_router_stats", "hidden_states",
           "hidden_states_with_router_stats", "init_model", "logical_axes", "router_routes",
           "vocab_kernel_VxE"]

ATTENTION_BLOCK = 256
"""Query positions whose attention scores exist at once (per row and head): longer
sequences are attended block by block, each block recomputed in the backward pass.
Float32 scores of 8 x 1,024 tokens with 14 heads are 470 MB per copy, per layer."""


REMAT_POLICIES = {
    # Keep only each layer's input; recompute the whole layer in the backward pass.
    "full": lambda: jax.checkpoint_policies.nothing_saveable,
    # Keep the outputs of the weight matmuls (q/k/v, o, gate/up, down: dots without
    # batch dimensions; the experts' ragged dots by name) and the attention output: the
    # backward pass recomputes only the elementwise work (norms, RoPE, SiLU), never a
    # matmul or a fused attention kernel.
    "dots": lambda: jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            jax.checkpoint_policies.save_only_these_names(ATTENTION_OUT, *EXPERT_OUTS)),
        saves_fused_attention),
}
"""Remat policies by name (`jax.checkpoint_policies`); "none" keeps every activation."""


def remat_policy_name(remat: bool | str) -> str:
    """The policy name of `remat`: "none", "dots" or "full" (True: "full", False: "none")."""
    if isinstance(remat, bool):
        return "full" if remat else "none"
    if remat != "none" and remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be one of {('none', *REMAT_POLICIES)}, got {remat!r}")
    return remat


@dataclasses.dataclass(frozen=True)
class Kernels:
    """How the layers compute, not what: the attention kernel and its xla block, and
    the most runs a packed row holds. Hashable, so it may sit in the graphdef."""

    attention: str = "xla"
    attention_block: int = 0
    max_segments: int = 0

    def __post_init__(self):
        if self.attention not in KERNELS:
            raise ValueError(f"attention must be one of {KERNELS}, got {self.attention!r}")
        if self.attention_block < 0:
            raise ValueError(f"attention_block must be >= 0 (0: unblocked), got "
                             f"{self.attention_block}")
        if self.max_segments < 0:
            raise ValueError(f"max_segments must be >= 0 (0: no bound), got {self.max_segments}")


@dataclasses.dataclass(frozen=True)
class AttentionMasks:
    """What attention reads of the packing, built once per forward pass for all layers."""

    mask_BxTxS: jax.Array | None
    segment_ids_BxT: jax.Array | None


def _param(rngs: nnx.Rngs, init, shape: tuple[int, ...], axes: tuple[str | None, ...],
           param_dtype) -> nnx.Param:
    # eager_sharding=False: no global mesh; the trainer places params from logical_axes().
    return nnx.Param(init(rngs.params(), shape, param_dtype), out_sharding=axes,
                     eager_sharding=False)


_normal = jax.nn.initializers.normal(0.02)  # HF initializer_range
_zeros = jax.nn.initializers.zeros
_ones = jax.nn.initializers.ones


def _adapter(rngs: nnx.Rngs, lora: LoraConfig | None, target: str, ins: tuple, outs: tuple,
             in_axes: tuple, out_axes: tuple, param_dtype):
    """(A, B) of a projection's LoRA adapter (fnrl.models.lora), or (None, None) when it
    has none. A is in-dims × r, B r × out-dims: heads stay apart, as in the kernels."""
    if lora is None or not lora.enabled or target not in lora.targets:
        return None, None
    r = lora.rank
    return (_param(rngs, adapter_a_init, (*ins, r), (*in_axes, "lora_rank"), param_dtype),
            _param(rngs, _zeros, (r, *outs), ("lora_rank", *out_axes), param_dtype))


class RMSNorm(nnx.Module):
    """HF RMSNorm (Qwen2, Qwen3, Llama alike): normalize in float32, cast, then scale."""

    def __init__(self, size: int, eps: float, *, rngs: nnx.Rngs, dtype, param_dtype):
        self.scale = _param(rngs, _ones, (size,), ("norm",), param_dtype)
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(self.dtype) * x32.astype(self.dtype)


def _rope(x_BxTxNxD: jax.Array, positions_BxT: jax.Array, inv_freq_F: jax.Array) -> jax.Array:
    """Rotate-half RoPE exactly as HF (non-interleaved halves), in float32."""
    angles_BxTxF = positions_BxT.astype(jnp.float32)[..., None] * inv_freq_F
    angles_BxTxD = jnp.concatenate([angles_BxTxF, angles_BxTxF], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles_BxTxD), jnp.sin(angles_BxTxD)
    x32 = x_BxTxNxD.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos + rotated * sin).astype(x_BxTxNxD.dtype)


class Attention(nnx.Module):
    """Grouped-query attention; q/k/v biases (qwen2) or per-head q/k norms (qwen3)."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs, dtype, param_dtype,
                 kernels: Kernels, lora: LoraConfig | None = None):
        E, H, K, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        p = lambda init, shape, axes: _param(rngs, init, shape, axes, param_dtype)
        self.q_kernel = p(_normal, (E, H, D), ("embed", "heads", "head_dim"))
        self.k_kernel = p(_normal, (E, K, D), ("embed", "kv_heads", "head_dim"))
        self.v_kernel = p(_normal, (E, K, D), ("embed", "kv_heads", "head_dim"))
        self.o_kernel = p(_normal, (H, D, E), ("heads", "head_dim", "embed"))
        ad = lambda target, ins, outs, in_axes, out_axes: _adapter(  # noqa: E731
            rngs, lora, target, ins, outs, in_axes, out_axes, param_dtype)
        self.q_lora_a, self.q_lora_b = ad("q_proj", (E,), (H, D), ("embed",), ("heads", "head_dim"))
        self.k_lora_a, self.k_lora_b = ad("k_proj", (E,), (K, D), ("embed",), ("kv_heads", "head_dim"))
        self.v_lora_a, self.v_lora_b = ad("v_proj", (E,), (K, D), ("embed",), ("kv_heads", "head_dim"))
        self.o_lora_a, self.o_lora_b = ad("o_proj", (H, D), (E,), ("heads", "head_dim"), ("embed",))
        self.lora_scaling = lora.scaling if lora is not None and lora.enabled else 0.0
        # Absent features are None (static), present ones Params: one assignment each,
        # as NNX fixes an attribute's kind when it is first set.
        bias = cfg.qkv_bias
        self.q_bias = p(_zeros, (H, D), ("heads", "head_dim")) if bias else None
        self.k_bias = p(_zeros, (K, D), ("kv_heads", "head_dim")) if bias else None
        self.v_bias = p(_zeros, (K, D), ("kv_heads", "head_dim")) if bias else None
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps, **kw) if cfg.qk_norm else None
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps, **kw) if cfg.qk_norm else None
        # A tuple, not an array: module attributes that are not Params must be hashable.
        self.inv_freq = tuple(float(f) for f in cfg.rope_inv_freq())
        self.dtype = dtype
        self.kernel, self.block = kernels.attention, kernels.attention_block
        self.max_segments = kernels.max_segments

    def _project_qkv(self, x_BxTxE):
        """q, k and v from one 2-D matmul over (B·T, E) against the three kernels side
        by side, concatenated here inside jit (the params keep HF's layout, one kernel per
        projection): on XLA's CPU backend one wide matmul and its gradient took about 10 %
        less of the train step than three einsums (lab/benchmarks/train_step.py's cpu preset,
        together with gate/up fused the same way in MLP)."""
        B, T, E = x_BxTxE.shape
        H, D = self.q_kernel.shape[1:]
        K = self.k_kernel.shape[1]
        kernels = (self.q_kernel, self.k_kernel, self.v_kernel)
        # P = (H + 2K)·D output columns, N = B·T tokens.
        kernel_ExP = jnp.concatenate([w[...].reshape(E, -1) for w in kernels], axis=1)
        y_NxP = x_BxTxE.reshape(B * T, E) @ kernel_ExP.astype(self.dtype)
        if self.q_bias is not None:
            biases = (self.q_bias, self.k_bias, self.v_bias)
            y_NxP = y_NxP + jnp.concatenate([b[...].reshape(-1) for b in biases]).astype(self.dtype)
        q, k, v = jnp.split(y_NxP, [H * D, (H + K) * D], axis=1)
        x_NxE = x_BxTxE.reshape(B * T, E)
        q, k, v = (y + lora_delta(x_NxE, a, b, self.lora_scaling) if a is not None else y
                   for y, a, b in ((q, self.q_lora_a, self.q_lora_b),
                                   (k, self.k_lora_a, self.k_lora_b),
                                   (v, self.v_lora_a, self.v_lora_b)))
        return q.reshape(B, T, H, D), k.reshape(B, T, K, D), v.reshape(B, T, K, D)

    def __call__(self, x_BxTxE, positions_BxT, masks: AttentionMasks):
        q_BxTxHxD, k_BxSxKxD, v_BxSxKxD = self._project_qkv(x_BxTxE)
        if self.q_norm is not None:  # Qwen3: normalise each head before rotating it
            q_BxTxHxD, k_BxSxKxD = self.q_norm(q_BxTxHxD), self.k_norm(k_BxSxKxD)
        inv_freq_F = jnp.asarray(self.inv_freq, jnp.float32)
        q_BxTxHxD = _rope(q_BxTxHxD, positions_BxT, inv_freq_F)
        k_BxSxKxD = _rope(k_BxSxKxD, positions_BxT, inv_freq_F)
        out_BxTxHxD = attend(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, kernel=self.kernel,
                             mask_BxTxS=masks.mask_BxTxS, segment_ids_BxT=masks.segment_ids_BxT,
                             max_segments=self.max_segments, block=self.block)
        y_BxTxE = jnp.einsum("bthd,hde->bte", out_BxTxHxD, self.o_kernel[...].astype(self.dtype))
        if self.o_lora_a is not None:
            B, T, H, D = out_BxTxHxD.shape
            y_BxTxE = y_BxTxE + lora_delta(out_BxTxHxD.reshape(B * T, H * D), self.o_lora_a,
                                           self.o_lora_b, self.lora_scaling).reshape(y_BxTxE.shape)
        return y_BxTxE


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs, dtype, param_dtype,
                 lora: LoraConfig | None = None):
        E, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_kernel = _param(rngs, _normal, (E, I), ("embed", "mlp"), param_dtype)
        self.up_kernel = _param(rngs, _normal, (E, I), ("embed", "mlp"), param_dtype)
        self.down_kernel = _param(rngs, _normal, (I, E), ("mlp", "embed"), param_dtype)
        ad = lambda target, ins, outs, in_axes, out_axes: _adapter(  # noqa: E731
            rngs, lora, target, ins, outs, in_axes, out_axes, param_dtype)
        self.gate_lora_a, self.gate_lora_b = ad("gate_proj", (E,), (I,), ("embed",), ("mlp",))
        self.up_lora_a, self.up_lora_b = ad("up_proj", (E,), (I,), ("embed",), ("mlp",))
        self.down_lora_a, self.down_lora_b = ad("down_proj", (I,), (E,), ("mlp",), ("embed",))
        self.lora_scaling = lora.scaling if lora is not None and lora.enabled else 0.0
        self.dtype = dtype

    def __call__(self, x_BxTxE):
        # gate and up as one 2-D matmul over (B·T, E), as q/k/v are (Attention._project_qkv).
        B, T, E = x_BxTxE.shape
        I = self.up_kernel.shape[1]
        w = lambda v: v[...].astype(self.dtype)
        kernel_Ex2I = jnp.concatenate([w(self.gate_kernel), w(self.up_kernel)], axis=1)
        x_NxE = x_BxTxE.reshape(B * T, E)
        gate_NxI, up_NxI = jnp.split(x_NxE @ kernel_Ex2I, 2, axis=1)
        delta = lambda x, a, b, y: y + lora_delta(x, a, b, self.lora_scaling) if a is not None else y  # noqa: E731
        gate_NxI = delta(x_NxE, self.gate_lora_a, self.gate_lora_b, gate_NxI)
        up_NxI = delta(x_NxE, self.up_lora_a, self.up_lora_b, up_NxI)
        hidden_NxI = jax.nn.silu(gate_NxI) * up_NxI
        out_NxE = delta(hidden_NxI, self.down_lora_a, self.down_lora_b,
                        hidden_NxI @ w(self.down_kernel))
        return out_NxE.reshape(B, T, E)


_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: attention then MLP, or then a mixture of experts."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs, dtype, param_dtype,
                 kernels: Kernels, lora: LoraConfig | None = None):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.attn = Attention(cfg, **kw, kernels=kernels, lora=lora)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        if cfg.is_moe and lora is not None and lora.enabled:
            experts = [t for t in lora.targets if t in _MLP_TARGETS]
            if experts:
                raise ValueError(f"lora.targets={lora.targets}: {experts} have no adapters on "
                                 f"{cfg.model_type}'s experts; target attention projections only")
        self.mlp = None if cfg.is_moe else MLP(cfg, **kw, lora=lora)
        self.moe = MoeBlock(cfg, dtype=dtype, param=lambda shape, axes: _param(
            rngs, _normal, shape, axes, param_dtype)) if cfg.is_moe else None

    def __call__(self, x_BxTxE, positions_BxT, masks: AttentionMasks, routes_BxTxK=None,
                 mask_BxT=None):
        """(x, router stats): the stats are `MoeBlock`'s, {} for a dense layer."""
        x_BxTxE = x_BxTxE + self.attn(self.input_norm(x_BxTxE), positions_BxT, masks)
        if self.moe is None:
            return x_BxTxE + self.mlp(self.post_attn_norm(x_BxTxE)), {}
        y_BxTxE, stats = self.moe(self.post_attn_norm(x_BxTxE), routes_BxTxK, mask_BxT)
        return x_BxTxE + y_BxTxE, stats


def _scan_layers_remat(layers, x_BxTxE, positions_BxT, masks: AttentionMasks, remat: str,
                       routes_LxBxTxK=None, mask_BxT=None):
    """The layers in turn as one `lax.scan` over their parameters stacked (a copy made
    inside jit; the param tree keeps one entry per layer), each layer rematerialised by
    the named policy (`REMAT_POLICIES`).

    A scan and not a Python loop of `jax.checkpoint`s: XLA's CPU scheduler moves an
    unrolled loop's recomputations into the forward pass, where they keep most of each
    layer's activations alive (about 1.1 of 1.5 GB per layer of the Qwen2.5-0.5B shape
    at 8 x 1,024 tokens, XLA's buffer plan); a scan's backward loop cannot be hoisted,
    so only each layer's input is kept.

    The layers are stacked in the compute dtype: every layer parameter is cast to it
    where it is used anyway (matmul kernels, biases, norm scales), so the results are
    the same, and the stacked copy and its gradient take half the bytes of float32
    master weights under bfloat16 compute (the gradient still reaches the master
    weights through the cast, as it does unstacked).

    Returns the last layer's output and the layers' router stats stacked over L; each
    layer takes its slice of the replayed routes as the scan goes.
    """
    graphdef, _ = nnx.split(layers[0])
    dtype = layers[0].input_norm.dtype
    stacked = jax.tree.map(lambda *xs: jnp.stack([x.astype(dtype) for x in xs]),
                           *(nnx.split(l)[1] for l in layers))

    @functools.partial(jax.checkpoint, policy=REMAT_POLICIES[remat]())
    def apply(x_BxTxE, layer):
        layer_state, routes_BxTxK = layer
        return nnx.merge(graphdef, layer_state)(x_BxTxE, positions_BxT, masks, routes_BxTxK,
                                                mask_BxT)

    return jax.lax.scan(apply, x_BxTxE, (stacked, routes_LxBxTxK))


class Decoder(nnx.Module):
    """Causal LM of any family in `FAMILIES`. Holds only `nnx.Param`s, so
    `nnx.split(model)` yields (graphdef, params).

    `dtype` is the compute dtype, `param_dtype` the storage dtype. `remat` names what each
    decoder layer keeps for the backward pass (`REMAT_POLICIES`; True is "full", False
    "none"): with a policy the layers run as one scan. `attention` names the kernel
    (fnrl.models.attention); the xla kernel attends rows longer than `attention_block`
    positions that many queries at a time (0: all at once), with the same results;
    packed rows hold at most `max_segments` runs (sequences and a padding tail; 0: no
    bound, as many as positions). `lora` (rank > 0) adds an adapter beside each targeted
    projection (fnrl.models.lora).
    """

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, remat: bool | str = "none",
                 attention: str = "xla", attention_block: int = ATTENTION_BLOCK,
                 max_segments: int = 0, lora: LoraConfig | None = None):
        kernels = Kernels(attention=attention, attention_block=attention_block,
                          max_segments=max_segments)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.embedding = _param(rngs, _normal, (cfg.vocab_size, cfg.hidden_size),
                                ("vocab", "embed"), param_dtype)
        self.layers = nnx.List([DecoderLayer(cfg, **kw, kernels=kernels, lora=lora)
                                for _ in range(cfg.num_hidden_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.lm_head = None if cfg.tie_word_embeddings else _param(
            rngs, _normal, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), param_dtype)
        self.dtype = dtype
        self.remat = remat_policy_name(remat)
        self.kernels = kernels

    def hidden_states(self, tokens_BxT, positions_BxT=None, segment_ids_BxT=None,
                      routes_BxTxLxK=None):
        """Final-normed hidden states B×T×E in the compute dtype, for callers that chunk
        the vocab projection (see `vocab_kernel_VxE`); `routes_BxTxLxK` replays a
        mixture of experts' routing (None: the model's own)."""
        return self._run(tokens_BxT, positions_BxT, segment_ids_BxT, routes_BxTxLxK)[0]

    def hidden_states_with_router_stats(self, tokens_BxT, positions_BxT=None,
                                        segment_ids_BxT=None, routes_BxTxLxK=None,
                                        mask_BxT=None):
        """(`hidden_states`, {"aux_loss", "route_disagreement"}): float32 scalars over the
        tokens `mask_BxT` keeps (all when None), pooled over layers as transformers pools
        them (fnrl.models.moe.reduce_layer_stats); zeros for a dense model."""
        h_BxTxE, stats_L = self._run(tokens_BxT, positions_BxT, segment_ids_BxT,
                                     routes_BxTxLxK, mask_BxT)
        moe = self.layers[0].moe
        num_experts = 0 if moe is None else moe.router_kernel.shape[1]
        return h_BxTxE, reduce_layer_stats(stats_L, num_experts)

    def router_routes(self, tokens_BxT, positions_BxT=None, segment_ids_BxT=None):
        """The router's own top-K expert ids B×T×L×K (int32), each layer's given the
        layers before it routed their own way: the routes whose replay changes nothing."""
        if self.layers[0].moe is None:
            raise ValueError("router_routes: a dense model has no experts to route to")
        _, stats_L = self._run(tokens_BxT, positions_BxT, segment_ids_BxT)
        return jnp.moveaxis(stats_L["routes_BxTxK"], 0, 2)

    def _check_routes(self, routes_BxTxLxK, B: int, T: int) -> None:
        moe = self.layers[0].moe
        if moe is None:
            raise ValueError("routes_BxTxLxK given to a dense model: only a mixture of "
                             "experts routes")
        expected = (B, T, len(self.layers), moe.top_k)
        if tuple(routes_BxTxLxK.shape) != expected:
            raise ValueError(f"routes_BxTxLxK has shape {tuple(routes_BxTxLxK.shape)}, expected "
                             f"{expected} (batch, tokens, layers, num_experts_per_tok)")

    def _run(self, tokens_BxT, positions_BxT=None, segment_ids_BxT=None, routes_BxTxLxK=None,
             mask_BxT=None):
        """(final-normed hidden states, the layers' router stats stacked over L: {} when
        dense)."""
        B, T = tokens_BxT.shape
        routes_LxBxTxK = None
        if routes_BxTxLxK is not None:
            self._check_routes(routes_BxTxLxK, B, T)
            routes_LxBxTxK = jnp.moveaxis(jnp.asarray(routes_BxTxLxK, jnp.int32), 2, 0)
        if positions_BxT is None:
            positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        # Packing: attend only within a sequence's run (the padding tail sees only itself).
        # The xla kernel's mask is built once here for every layer; cudnn takes the ids.
        mask_BxTxS = None
        if self.kernels.attention == "xla":
            mask_BxTxS = causal_mask(B, T, segment_ids_BxT, self.kernels.max_segments)
        masks = AttentionMasks(mask_BxTxS=mask_BxTxS, segment_ids_BxT=segment_ids_BxT)
        # Gather the rows, then cast: casting the whole V×E table first would copy it.
        x_BxTxE = self.embedding[...][tokens_BxT].astype(self.dtype)
        if self.remat != "none":
            x_BxTxE, stats_L = _scan_layers_remat(self.layers, x_BxTxE, positions_BxT, masks,
                                                  self.remat, routes_LxBxTxK, mask_BxT)
        else:
            stats = []
            for i, layer in enumerate(self.layers):
                routes_BxTxK = None if routes_LxBxTxK is None else routes_LxBxTxK[i]
                x_BxTxE, layer_stats = layer(x_BxTxE, positions_BxT, masks, routes_BxTxK, mask_BxT)
                stats.append(layer_stats)
            stats_L = jax.tree.map(lambda *xs: jnp.stack(xs), *stats)
        return self.final_norm(x_BxTxE), stats_L

    def vocab_kernel_VxE(self) -> jax.Array:
        """The output projection as V×E in the compute dtype, tied or not. Inside jit the
        untied transpose folds into the consuming dot, so this costs no copy there."""
        if self.lm_head is None:
            return self.embedding[...].astype(self.dtype)
        return self.lm_head[...].astype(self.dtype).T

    def logits(self, h_BxTxE):
        """Vocab projection, accumulated and returned in float32."""
        return jnp.einsum("bte,ve->btv", h_BxTxE, self.vocab_kernel_VxE(),
                          preferred_element_type=jnp.float32)

    def __call__(self, tokens_BxT, positions_BxT=None, segment_ids_BxT=None,
                 routes_BxTxLxK=None):
        """Returns float32 logits B×T×V; positions default to arange, segments to one per
        row, routes to the model's own."""
        return self.logits(self.hidden_states(tokens_BxT, positions_BxT, segment_ids_BxT,
                                              routes_BxTxLxK))


def forward(graphdef: nnx.GraphDef, params, tokens_BxT, positions_BxT=None, segment_ids_BxT=None,
            routes_BxTxLxK=None):
    """Pure forward pass over (graphdef, params) to float32 logits; jit this, not the module."""
    return nnx.merge(graphdef, params)(tokens_BxT, positions_BxT, segment_ids_BxT, routes_BxTxLxK)


def hidden_states(graphdef: nnx.GraphDef, params, tokens_BxT, positions_BxT=None,
                  segment_ids_BxT=None, routes_BxTxLxK=None):
    """Pure `Decoder.hidden_states`: final-normed B×T×E in the compute dtype."""
    return nnx.merge(graphdef, params).hidden_states(tokens_BxT, positions_BxT, segment_ids_BxT,
                                                     routes_BxTxLxK)


def forward_with_router_stats(graphdef: nnx.GraphDef, params, tokens_BxT, positions_BxT=None,
                              segment_ids_BxT=None, routes_BxTxLxK=None, mask_BxT=None):
    """Pure (float32 logits, {"aux_loss", "route_disagreement"}): `forward` and the
    router statistics of `Decoder.hidden_states_with_router_stats`."""
    model = nnx.merge(graphdef, params)
    h_BxTxE, stats = model.hidden_states_with_router_stats(
        tokens_BxT, positions_BxT, segment_ids_BxT, routes_BxTxLxK, mask_BxT)
    return model.logits(h_BxTxE), stats


def hidden_states_with_router_stats(graphdef: nnx.GraphDef, params, tokens_BxT,
                                    positions_BxT=None, segment_ids_BxT=None,
                                    routes_BxTxLxK=None, mask_BxT=None):
    """Pure `Decoder.hidden_states_with_router_stats`, for callers that chunk the vocab
    projection."""
    return nnx.merge(graphdef, params).hidden_states_with_router_stats(
        tokens_BxT, positions_BxT, segment_ids_BxT, routes_BxTxLxK, mask_BxT)


def router_routes(graphdef: nnx.GraphDef, params, tokens_BxT, positions_BxT=None,
                  segment_ids_BxT=None):
    """Pure `Decoder.router_routes`: the model's own expert ids B×T×L×K."""
    return nnx.merge(graphdef, params).router_routes(tokens_BxT, positions_BxT, segment_ids_BxT)


def vocab_kernel_VxE(graphdef: nnx.GraphDef, params):
    """Pure `Decoder.vocab_kernel_VxE`: the V×E output projection in the compute dtype."""
    return nnx.merge(graphdef, params).vocab_kernel_VxE()


def init_model(cfg: DecoderConfig, seed: int, *, dtype=jnp.float32, param_dtype=jnp.float32,
               **kernels):
    """Randomly initialised model as (graphdef, params) with params a pure dict of jax
    arrays; `kernels` are Decoder's remat, attention, attention_block, max_segments and
    lora."""
    model = Decoder(cfg, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=param_dtype, **kernels)
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def abstract_model(cfg: DecoderConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
                   **kernels):
    """(graphdef, abstract param state) without allocating; state leaves keep their metadata.

    For sharded initialisation: `jax.jit(init, out_shardings=...)` over the shapes of
    `nnx.to_pure_dict(state)`.
    """
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0), dtype=dtype,
                                           param_dtype=param_dtype, **kernels))
    return nnx.split(model)


def logical_axes(cfg: DecoderConfig, lora: LoraConfig | None = None) -> dict:
    """Logical axis-name tuples in a pure dict shaped like `params`.

    Tuples are subtrees to JAX, so map with params first:
    `jax.tree.map(lambda p, names: rules_to_sharding(names), params, logical_axes(cfg))`.
    """
    _, state = abstract_model(cfg, lora=lora)
    return nnx.to_pure_dict(state, lambda var: var.get_metadata("out_sharding"))
