"""A decoder-only transformer in Flax NNX (Qwen2, Qwen2.5, Qwen3, Llama 3), numerically matching Hugging Face.

The module is a definition language only: build it once, split it with
`graphdef, params = nnx.split(model)` and run `forward(graphdef, params, ...)`.
`params` is the pure nested dict `nnx.to_pure_dict(state)`:

    {'embedding': V×E,
     'layers': {i: {'input_norm': {'scale': E},
                    'attn': {'q_kernel': E×H×D, 'q_bias': H×D,
                             'k_kernel': E×K×D, 'k_bias': K×D,
                             'v_kernel': E×K×D, 'v_bias': K×D,
                             'o_kernel': H×D×E},
                    'post_attn_norm': {'scale': E},
                    'mlp': {'gate_kernel': E×I, 'up_kernel': E×I, 'down_kernel': I×E}}},
     'final_norm': {'scale': E},
     'lm_head': E×V}                      # only when tie_word_embeddings is False

Every parameter carries logical axis names as NNX `out_sharding` metadata;
`logical_axes(cfg)` returns them as a pytree shaped like `params`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

_REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Architecture of a Qwen2 model; field names and defaults follow HF `config.json`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be divisible by "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} must be divisible by "
                    f"num_attention_heads={self.num_attention_heads} when head_dim is None")
            # Resolved once so every consumer reads one int.
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or (
                self.head_dim <= 0 or self.head_dim % 2):
            raise ValueError(f"head_dim must be a positive even int (RoPE), got {self.head_dim!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            ids = value if isinstance(value, tuple) else (value,)
            if value is not None and not all(isinstance(i, int) and i >= 0 for i in ids):
                raise ValueError(f"{name} must be None or a non-negative int, got {value!r}")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> DecoderConfig:
        """Builds a config from an HF `config.json` dict; unknown keys are ignored."""
        missing = [k for k in _REQUIRED_HF_KEYS if k not in hf]
        if missing:
            raise ValueError(f"HF config is missing required keys: {missing}")
        if hf.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True is not supported")
        # transformers>=5 nests the theta in rope_parameters; older configs keep it top level.
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"only default RoPE is supported, got rope_parameters={rope!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in hf.items() if k in fields}
        kwargs["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", cls.rope_theta)))
        if kwargs.get("num_key_value_heads") is None:
            kwargs["num_key_value_heads"] = hf["num_attention_heads"]
        return cls(**kwargs)

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """Returns a complete HF `config.json` dict loadable by transformers and vLLM."""
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            # Both spellings: transformers>=5 reads rope_parameters, older readers rope_theta.
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_scaling": None,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "torch_dtype": dtype,
            "dtype": dtype,
        }


def _param(rngs: nnx.Rngs, init, shape: tuple[int, ...], axes: tuple[str | None, ...],
           param_dtype) -> nnx.Param:
    # eager_sharding=False: no global mesh; the trainer places params from logical_axes().
    return nnx.Param(init(rngs.params(), shape, param_dtype), out_sharding=axes,
                     eager_sharding=False)


_normal = jax.nn.initializers.normal(0.02)  # HF initializer_range
_zeros = jax.nn.initializers.zeros
_ones = jax.nn.initializers.ones


class RMSNorm(nnx.Module):
    """HF Qwen2RMSNorm: normalize in float32, cast back, then scale."""

    def __init__(self, size: int, eps: float, *, rngs: nnx.Rngs, dtype, param_dtype):
        self.scale = _param(rngs, _ones, (size,), ("norm",), param_dtype)
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x_BxTxE: jax.Array) -> jax.Array:
        x32 = x_BxTxE.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(self.dtype) * x32.astype(self.dtype)


def _rope(x_BxTxNxD: jax.Array, positions_BxT: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE exactly as HF (non-interleaved halves)."""
    d = x_BxTxNxD.shape[-1]
    inv_freq_F = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles_BxTxF = positions_BxT.astype(jnp.float32)[..., None] * inv_freq_F
    angles_BxTxD = jnp.concatenate([angles_BxTxF, angles_BxTxF], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles_BxTxD), jnp.sin(angles_BxTxD)
    x1, x2 = jnp.split(x_BxTxNxD.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x_BxTxNxD * cos + rotated * sin).astype(x_BxTxNxD.dtype)


class Attention(nnx.Module):
    """Grouped-query attention with q/k/v biases and no output bias."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        E, H, K, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        p = lambda init, shape, axes: _param(rngs, init, shape, axes, param_dtype)
        self.q_kernel = p(_normal, (E, H, D), ("embed", "heads", "head_dim"))
        self.q_bias = p(_zeros, (H, D), ("heads", "head_dim"))
        self.k_kernel = p(_normal, (E, K, D), ("embed", "kv_heads", "head_dim"))
        self.k_bias = p(_zeros, (K, D), ("kv_heads", "head_dim"))
        self.v_kernel = p(_normal, (E, K, D), ("embed", "kv_heads", "head_dim"))
        self.v_bias = p(_zeros, (K, D), ("kv_heads", "head_dim"))
        self.o_kernel = p(_normal, (H, D, E), ("heads", "head_dim", "embed"))
        self.rope_theta = cfg.rope_theta
        self.dtype = dtype

    def __call__(self, x_BxTxE, positions_BxT, mask_BxTxS):
        w = lambda v: v[...].astype(self.dtype)
        q_BxTxHxD = jnp.einsum("bte,ehd->bthd", x_BxTxE, w(self.q_kernel)) + w(self.q_bias)
        k_BxSxKxD = jnp.einsum("bte,ekd->btkd", x_BxTxE, w(self.k_kernel)) + w(self.k_bias)
        v_BxSxKxD = jnp.einsum("bte,ekd->btkd", x_BxTxE, w(self.v_kernel)) + w(self.v_bias)
        q_BxTxHxD = _rope(q_BxTxHxD, positions_BxT, self.rope_theta)
        k_BxSxKxD = _rope(k_BxSxKxD, positions_BxT, self.rope_theta)

        # Query head h uses kv head h // G, as HF repeat_kv does; grouping avoids the copy.
        B, T, H, D = q_BxTxHxD.shape
        K = k_BxSxKxD.shape[2]
        q_BxTxKxGxD = q_BxTxHxD.reshape(B, T, K, H // K, D)
        scores_BxKxGxTxS = jnp.einsum("btkgd,bskd->bkgts", q_BxTxKxGxD, k_BxSxKxD,
                                      preferred_element_type=jnp.float32) * D**-0.5
        # finfo.min instead of -inf: the diagonal is always visible, so no row is all-masked.
        scores_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None], scores_BxKxGxTxS,
                                     jnp.finfo(jnp.float32).min)
        probs_BxKxGxTxS = jax.nn.softmax(scores_BxKxGxTxS, axis=-1).astype(self.dtype)
        out_BxTxKxGxD = jnp.einsum("bkgts,bskd->btkgd", probs_BxKxGxTxS, v_BxSxKxD)
        return jnp.einsum("bthd,hde->bte", out_BxTxKxGxD.reshape(B, T, H, D), w(self.o_kernel))


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        E, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_kernel = _param(rngs, _normal, (E, I), ("embed", "mlp"), param_dtype)
        self.up_kernel = _param(rngs, _normal, (E, I), ("embed", "mlp"), param_dtype)
        self.down_kernel = _param(rngs, _normal, (I, E), ("mlp", "embed"), param_dtype)
        self.dtype = dtype

    def __call__(self, x_BxTxE):
        w = lambda v: v[...].astype(self.dtype)
        gate_BxTxI = jax.nn.silu(x_BxTxE @ w(self.gate_kernel))
        return (gate_BxTxI * (x_BxTxE @ w(self.up_kernel))) @ w(self.down_kernel)


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.attn = Attention(cfg, **kw)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mlp = MLP(cfg, **kw)

    def __call__(self, x_BxTxE, positions_BxT, mask_BxTxS):
        x_BxTxE = x_BxTxE + self.attn(self.input_norm(x_BxTxE), positions_BxT, mask_BxTxS)
        return x_BxTxE + self.mlp(self.post_attn_norm(x_BxTxE))


class Decoder(nnx.Module):
    """Qwen2 causal LM. Holds only `nnx.Param`s, so `nnx.split(model)` yields (graphdef, params)."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.embedding = _param(rngs, _normal, (cfg.vocab_size, cfg.hidden_size),
                                ("vocab", "embed"), param_dtype)
        self.layers = nnx.List([DecoderLayer(cfg, **kw) for _ in range(cfg.num_hidden_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.lm_head = None if cfg.tie_word_embeddings else _param(
            rngs, _normal, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), param_dtype)
        self.dtype = dtype

    def hidden_states(self, tokens_BxT, positions_BxT=None, segment_ids_BxT=None):
        """Final-normed hidden states B×T×E, for callers that chunk the vocab projection."""
        B, T = tokens_BxT.shape
        if positions_BxT is None:
            positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        mask_BxTxS = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), dtype=bool)), (B, T, T))
        if segment_ids_BxT is not None:
            # Packing: attend only within the same segment (padding id 0 sees only padding).
            mask_BxTxS = mask_BxTxS & (segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :])
        x_BxTxE = self.embedding[...].astype(self.dtype)[tokens_BxT]
        for layer in self.layers:
            x_BxTxE = layer(x_BxTxE, positions_BxT, mask_BxTxS)
        return self.final_norm(x_BxTxE)

    def logits(self, h_BxTxE):
        """Vocab projection, accumulated and returned in float32."""
        if self.lm_head is None:
            kernel_VxE = self.embedding[...].astype(self.dtype)
            return jnp.einsum("bte,ve->btv", h_BxTxE, kernel_VxE, preferred_element_type=jnp.float32)
        kernel_ExV = self.lm_head[...].astype(self.dtype)
        return jnp.einsum("bte,ev->btv", h_BxTxE, kernel_ExV, preferred_element_type=jnp.float32)

    def __call__(self, tokens_BxT, positions_BxT=None, segment_ids_BxT=None):
        """Returns float32 logits B×T×V; positions default to arange, segments to one per row."""
        return self.logits(self.hidden_states(tokens_BxT, positions_BxT, segment_ids_BxT))


def forward(graphdef: nnx.GraphDef, params, tokens_BxT, positions_BxT=None, segment_ids_BxT=None):
    """Pure forward pass over (graphdef, params); jit this, not the module."""
    return nnx.merge(graphdef, params)(tokens_BxT, positions_BxT, segment_ids_BxT)


def init_model(cfg: DecoderConfig, seed: int, *, dtype=jnp.float32, param_dtype=jnp.float32):
    """Randomly initialised model as (graphdef, params) with params a pure dict of jax arrays."""
    model = Decoder(cfg, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=param_dtype)
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def abstract_model(cfg: DecoderConfig, *, dtype=jnp.float32, param_dtype=jnp.float32):
    """(graphdef, abstract param state) without allocating; state leaves keep their metadata."""
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0), dtype=dtype,
                                         param_dtype=param_dtype))
    return nnx.split(model)


def logical_axes(cfg: DecoderConfig) -> dict:
    """Logical axis-name tuples in a pure dict shaped like `params`.

    Tuples are subtrees to JAX, so map with params first:
    `jax.tree.map(lambda p, names: rules_to_sharding(names), params, logical_axes(cfg))`.
    """
    _, state = abstract_model(cfg)
    return nnx.to_pure_dict(state, lambda var: var.get_metadata("out_sharding"))
