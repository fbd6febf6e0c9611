"""A decoder-only transformer in Flax NNX (Qwen2, Qwen2.5, Qwen3, Llama 3), numerically matching Hugging Face.

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
     'final_norm': {'scale': E},
     'lm_head': E×V}                      # only when tie_word_embeddings is False

Every parameter carries logical axis names as NNX `out_sharding` metadata;
`logical_axes(cfg)` returns them as a pytree shaped like `params`.

Dtypes: parameters are stored in `param_dtype` and cast to the compute `dtype` where
they are used, so bfloat16 compute over float32 master weights needs no second copy.
Norms, softmax and RoPE run in float32 whatever `dtype` is, and the vocab projection
accumulates in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from fnrl.models.families import FAMILIES, DecoderConfig, Llama3RopeScaling

__all__ = ["ATTENTION_BLOCK", "FAMILIES", "Decoder", "DecoderConfig", "Llama3RopeScaling", "abstract_model",
           "forward", "hidden_states", "init_model", "logical_axes", "vocab_kernel_VxE"]

ATTENTION_BLOCK = 256
"""Query positions whose attention scores exist at once (per row and head): longer
sequences are attended block by block, each block recomputed in the backward pass.
Float32 scores of 8 x 1,024 tokens with 14 heads are 470 MB per copy, per layer."""


def _param(rngs: nnx.Rngs, init, shape: tuple[int, ...], axes: tuple[str | None, ...],
           param_dtype) -> nnx.Param:
    # eager_sharding=False: no global mesh; the trainer places params from logical_axes().
    return nnx.Param(init(rngs.params(), shape, param_dtype), out_sharding=axes,
                     eager_sharding=False)


_normal = jax.nn.initializers.normal(0.02)  # HF initializer_range
_zeros = jax.nn.initializers.zeros
_ones = jax.nn.initializers.ones


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
                 block: int = 0):
        E, H, K, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        p = lambda init, shape, axes: _param(rngs, init, shape, axes, param_dtype)
        self.q_kernel = p(_normal, (E, H, D), ("embed", "heads", "head_dim"))
        self.k_kernel = p(_normal, (E, K, D), ("embed", "kv_heads", "head_dim"))
        self.v_kernel = p(_normal, (E, K, D), ("embed", "kv_heads", "head_dim"))
        self.o_kernel = p(_normal, (H, D, E), ("heads", "head_dim", "embed"))
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
        self.block = int(block)

    def _project_qkv(self, x_BxTxE):
        """q, k and v from one 2-D matmul over (B·T, E) against the three kernels side
        by side, concatenated here inside jit (the params keep HF's layout, one kernel per
        projection): on XLA's CPU backend one wide matmul and its gradient took about 10 %
        less of the train step than three einsums (benchmarks/train_step.py's cpu preset,
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
        return q.reshape(B, T, H, D), k.reshape(B, T, K, D), v.reshape(B, T, K, D)

    def __call__(self, x_BxTxE, positions_BxT, mask_BxTxS):
        q_BxTxHxD, k_BxSxKxD, v_BxSxKxD = self._project_qkv(x_BxTxE)
        if self.q_norm is not None:  # Qwen3: normalise each head before rotating it
            q_BxTxHxD, k_BxSxKxD = self.q_norm(q_BxTxHxD), self.k_norm(k_BxSxKxD)
        inv_freq_F = jnp.asarray(self.inv_freq, jnp.float32)
        q_BxTxHxD = _rope(q_BxTxHxD, positions_BxT, inv_freq_F)
        k_BxSxKxD = _rope(k_BxSxKxD, positions_BxT, inv_freq_F)

        # Query head h uses kv head h // G, as HF repeat_kv does; grouping avoids the copy.
        B, T, H, D = q_BxTxHxD.shape
        K = k_BxSxKxD.shape[2]
        q_BxTxKxGxD = q_BxTxHxD.reshape(B, T, K, H // K, D)
        block = self.block if 0 < self.block < T else T
        outs = []
        for start in range(0, T, block):
            stop = min(start + block, T)
            # Keys after a block's last query are masked (causal), so they are left out;
            # checkpointed, a block's scores live only while its output or its gradient
            # is being computed.
            attend = jax.checkpoint(_attend) if block < T else _attend
            outs.append(attend(q_BxTxKxGxD[:, start:stop], k_BxSxKxD[:, :stop],
                               v_BxSxKxD[:, :stop], mask_BxTxS[:, start:stop, :stop]))
        out_BxTxKxGxD = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
        return jnp.einsum("bthd,hde->bte", out_BxTxKxGxD.reshape(B, T, H, D),
                          self.o_kernel[...].astype(self.dtype))


def _attend(q_BxTxKxGxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS):
    """Softmax attention of T queries over S keys, scores and softmax in float32."""
    D = q_BxTxKxGxD.shape[-1]
    scores_BxKxGxTxS = jnp.einsum("btkgd,bskd->bkgts", q_BxTxKxGxD, k_BxSxKxD,
                                  preferred_element_type=jnp.float32) * D**-0.5
    # finfo.min instead of -inf: the diagonal is always visible, so no row is all-masked.
    scores_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None], scores_BxKxGxTxS,
                                 jnp.finfo(jnp.float32).min)
    probs_BxKxGxTxS = jax.nn.softmax(scores_BxKxGxTxS, axis=-1).astype(q_BxTxKxGxD.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs_BxKxGxTxS, v_BxSxKxD)


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        E, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_kernel = _param(rngs, _normal, (E, I), ("embed", "mlp"), param_dtype)
        self.up_kernel = _param(rngs, _normal, (E, I), ("embed", "mlp"), param_dtype)
        self.down_kernel = _param(rngs, _normal, (I, E), ("mlp", "embed"), param_dtype)
        self.dtype = dtype

    def __call__(self, x_BxTxE):
        # gate and up as one 2-D matmul over (B·T, E), as q/k/v are (Attention._project_qkv).
        B, T, E = x_BxTxE.shape
        I = self.up_kernel.shape[1]
        w = lambda v: v[...].astype(self.dtype)
        kernel_Ex2I = jnp.concatenate([w(self.gate_kernel), w(self.up_kernel)], axis=1)
        gate_up_Nx2I = x_BxTxE.reshape(B * T, E) @ kernel_Ex2I
        hidden_NxI = jax.nn.silu(gate_up_Nx2I[:, :I]) * gate_up_Nx2I[:, I:]
        return (hidden_NxI @ w(self.down_kernel)).reshape(B, T, E)


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs, dtype, param_dtype,
                 attention_block: int = 0):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.attn = Attention(cfg, **kw, block=attention_block)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mlp = MLP(cfg, **kw)

    def __call__(self, x_BxTxE, positions_BxT, mask_BxTxS):
        x_BxTxE = x_BxTxE + self.attn(self.input_norm(x_BxTxE), positions_BxT, mask_BxTxS)
        return x_BxTxE + self.mlp(self.post_attn_norm(x_BxTxE))


def _scan_layers_remat(layers, x_BxTxE, positions_BxT, mask_BxTxS):
    """The layers in turn as one `lax.scan` over their parameters stacked (a copy made
    inside jit; the param tree keeps one entry per layer), each layer rematerialised.

    A scan and not a Python loop of `jax.checkpoint`s: XLA's CPU scheduler moves an
    unrolled loop's recomputations into the forward pass, where they keep most of each
    layer's activations alive (about 1.1 of 1.5 GB per layer of the Qwen2.5-0.5B shape
    at 8 x 1,024 tokens, XLA's buffer plan); a scan's backward loop cannot be hoisted,
    so only each layer's input is kept.
    """
    graphdef, _ = nnx.split(layers[0])
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(nnx.split(l)[1] for l in layers))

    @jax.checkpoint
    def apply(x_BxTxE, layer_state):
        return nnx.merge(graphdef, layer_state)(x_BxTxE, positions_BxT, mask_BxTxS), None

    return jax.lax.scan(apply, x_BxTxE, stacked)[0]


class Decoder(nnx.Module):
    """Causal LM of any family in `FAMILIES`. Holds only `nnx.Param`s, so
    `nnx.split(model)` yields (graphdef, params).

    `dtype` is the compute dtype, `param_dtype` the storage dtype; `remat` recomputes
    each decoder layer in the backward pass instead of keeping its activations (the
    layers then run as one scan); rows longer than `attention_block` positions are
    attended that many queries at a time (0: all at once), with the same results.
    """

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, remat: bool = False,
                 attention_block: int = ATTENTION_BLOCK):
        if attention_block < 0:
            raise ValueError(f"attention_block must be >= 0 (0: unblocked), got {attention_block}")
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.embedding = _param(rngs, _normal, (cfg.vocab_size, cfg.hidden_size),
                                ("vocab", "embed"), param_dtype)
        self.layers = nnx.List([DecoderLayer(cfg, **kw, attention_block=attention_block)
                                for _ in range(cfg.num_hidden_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.lm_head = None if cfg.tie_word_embeddings else _param(
            rngs, _normal, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), param_dtype)
        self.dtype = dtype
        self.remat = bool(remat)

    def hidden_states(self, tokens_BxT, positions_BxT=None, segment_ids_BxT=None):
        """Final-normed hidden states B×T×E in the compute dtype, for callers that chunk
        the vocab projection (see `vocab_kernel_VxE`)."""
        B, T = tokens_BxT.shape
        if positions_BxT is None:
            positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        mask_BxTxS = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), dtype=bool)), (B, T, T))
        if segment_ids_BxT is not None:
            # Packing: attend only within the same segment (padding id 0 sees only padding).
            mask_BxTxS = mask_BxTxS & (segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :])
        # Gather the rows, then cast: casting the whole V×E table first would copy it.
        x_BxTxE = self.embedding[...][tokens_BxT].astype(self.dtype)
        if self.remat:
            x_BxTxE = _scan_layers_remat(self.layers, x_BxTxE, positions_BxT, mask_BxTxS)
        else:
            for layer in self.layers:
                x_BxTxE = layer(x_BxTxE, positions_BxT, mask_BxTxS)
        return self.final_norm(x_BxTxE)

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

    def __call__(self, tokens_BxT, positions_BxT=None, segment_ids_BxT=None):
        """Returns float32 logits B×T×V; positions default to arange, segments to one per row."""
        return self.logits(self.hidden_states(tokens_BxT, positions_BxT, segment_ids_BxT))


def forward(graphdef: nnx.GraphDef, params, tokens_BxT, positions_BxT=None, segment_ids_BxT=None):
    """Pure forward pass over (graphdef, params) to float32 logits; jit this, not the module."""
    return nnx.merge(graphdef, params)(tokens_BxT, positions_BxT, segment_ids_BxT)


def hidden_states(graphdef: nnx.GraphDef, params, tokens_BxT, positions_BxT=None,
                  segment_ids_BxT=None):
    """Pure `Decoder.hidden_states`: final-normed B×T×E in the compute dtype."""
    return nnx.merge(graphdef, params).hidden_states(tokens_BxT, positions_BxT, segment_ids_BxT)


def vocab_kernel_VxE(graphdef: nnx.GraphDef, params):
    """Pure `Decoder.vocab_kernel_VxE`: the V×E output projection in the compute dtype."""
    return nnx.merge(graphdef, params).vocab_kernel_VxE()


def init_model(cfg: DecoderConfig, seed: int, *, dtype=jnp.float32, param_dtype=jnp.float32,
               remat: bool = False, attention_block: int = ATTENTION_BLOCK):
    """Randomly initialised model as (graphdef, params) with params a pure dict of jax arrays."""
    model = Decoder(cfg, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=param_dtype, remat=remat,
                    attention_block=attention_block)
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def abstract_model(cfg: DecoderConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
                   remat: bool = False, attention_block: int = ATTENTION_BLOCK):
    """(graphdef, abstract param state) without allocating; state leaves keep their metadata.

    For sharded initialisation: `jax.jit(init, out_shardings=...)` over the shapes of
    `nnx.to_pure_dict(state)`.
    """
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0), dtype=dtype,
                                           param_dtype=param_dtype, remat=remat,
                                           attention_block=attention_block))
    return nnx.split(model)


def logical_axes(cfg: DecoderConfig) -> dict:
    """Logical axis-name tuples in a pure dict shaped like `params`.

    Tuples are subtrees to JAX, so map with params first:
    `jax.tree.map(lambda p, names: rules_to_sharding(names), params, logical_axes(cfg))`.
    """
    _, state = abstract_model(cfg)
    return nnx.to_pure_dict(state, lambda var: var.get_metadata("out_sharding"))
