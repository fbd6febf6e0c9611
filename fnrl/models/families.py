"""The architecture of each supported decoder family, and its Hugging Face `config.json`.

Families and what sets them apart (everything else is shared: pre-norm RMSNorm blocks,
grouped-query attention, rotate-half RoPE, SwiGLU MLP, optional tied embeddings):

    qwen2      (Qwen2, Qwen2.5)  q/k/v projections carry biases
    qwen3                        no biases; per-head RMSNorm of q and k before RoPE
    llama      (Llama 3, 3.x)    no biases; RoPE often scaled with rope_type "llama3"
    qwen3_moe  (Qwen3 MoE)       qwen3's attention; each MLP a mixture of experts
                                 (fnrl.models.moe): a router picks num_experts_per_tok
                                 of num_experts SwiGLU experts per token

A feature fnrl does not implement (sliding windows, yarn or linear RoPE, MLP or output
biases, another activation, dense layers between sparse ones) is refused by
`DecoderConfig.from_hf` with a ValueError naming the config key, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from fnrl.config.base import check

FAMILIES = ("qwen2", "qwen3", "llama", "qwen3_moe")
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
MOE_FAMILIES = ("qwen3_moe",)
# The mixture-of-experts fields, HF's names and defaults (Qwen3MoeConfig's where it has
# one; the sizes have none worth guessing, so a config.json must give them).
_MOE_REQUIRED_HF_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
_MOE_DEFAULTS = {"num_experts": None, "num_experts_per_tok": None,
                 "moe_intermediate_size": None, "norm_topk_prob": False,
                 "router_aux_loss_coef": 0.001, "decoder_sparse_step": 1, "mlp_only_layers": ()}
_REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads")


def _positive_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value > 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Llama3RopeScaling:
    """RoPE frequency scaling of Llama 3.1+ (`rope_type: "llama3"`): wavelengths longer
    than original/low_freq_factor are stretched by `factor`, shorter than
    original/high_freq_factor kept, and those between interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        name = type(self).__name__
        for field in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, field)
            check(isinstance(value, (int, float)) and value > 0, name, field, value, "must be > 0")
        check(self.high_freq_factor > self.low_freq_factor, name, "high_freq_factor",
              self.high_freq_factor, f"must exceed low_freq_factor={self.low_freq_factor}")
        check(_positive_int(self.original_max_position_embeddings), name,
              "original_max_position_embeddings", self.original_max_position_embeddings,
              "must be a positive int")

    def to_hf(self) -> dict[str, Any]:
        return {"rope_type": "llama3", "factor": self.factor,
                "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Architecture of one model; field names and defaults follow HF `config.json`.

    `model_type` picks the family (see the module docstring); the family's fixed
    features are the properties `qkv_bias`, `qk_norm` and `is_moe`. The MoE fields
    (num_experts ... mlp_only_layers) are HF Qwen3MoeConfig's; a dense family leaves
    them at their defaults. `intermediate_size` is a MoE config's dense-MLP width, which
    no layer uses while every layer is sparse.
    """

    model_type: str = "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.001
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
        name = type(self).__name__
        check(self.model_type in FAMILIES, name, "model_type", self.model_type,
              f"must be one of {FAMILIES}")
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, field)
            check(_positive_int(value), name, field, value, "must be a positive int")
        check(self.num_attention_heads % self.num_key_value_heads == 0, name,
              "num_key_value_heads", self.num_key_value_heads,
              f"must divide num_attention_heads={self.num_attention_heads}")
        if self.head_dim is None:
            check(self.hidden_size % self.num_attention_heads == 0, name, "hidden_size",
                  self.hidden_size, f"must be divisible by num_attention_heads="
                  f"{self.num_attention_heads} when head_dim is None")
            # Resolved once so every consumer reads one int.
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        check(_positive_int(self.head_dim) and self.head_dim % 2 == 0, name, "head_dim",
              self.head_dim, "must be a positive even int (RoPE rotates halves)")
        for field in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, field)
            check(isinstance(value, (int, float)) and value > 0, name, field, value, "must be > 0")
        check(self.rope_scaling is None or isinstance(self.rope_scaling, Llama3RopeScaling),
              name, "rope_scaling", self.rope_scaling, "must be None or a Llama3RopeScaling")
        check(isinstance(self.tie_word_embeddings, bool), name, "tie_word_embeddings",
              self.tie_word_embeddings, "must be a bool")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, field)
            ids = value if isinstance(value, tuple) else (value,)
            check(value is None or all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                       for i in ids), name, field, value,
                  "must be None, a non-negative int or a tuple of them")
        if isinstance(self.mlp_only_layers, list) or self.mlp_only_layers is None:
            # HF writes a list, older configs null for none.
            object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers or ()))
        if self.is_moe:
            self._check_moe(name)
        else:
            for field, default in _MOE_DEFAULTS.items():
                check(getattr(self, field) == default, name, field, getattr(self, field),
                      f"is a mixture-of-experts field: only {MOE_FAMILIES} set it")

    def _check_moe(self, name: str) -> None:
        for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, field)
            check(_positive_int(value), name, field, value, "must be a positive int")
        check(self.num_experts_per_tok <= self.num_experts, name, "num_experts_per_tok",
              self.num_experts_per_tok, f"must be <= num_experts={self.num_experts}")
        check(isinstance(self.norm_topk_prob, bool), name, "norm_topk_prob",
              self.norm_topk_prob, "must be a bool")
        coef = self.router_aux_loss_coef
        check(isinstance(coef, (int, float)) and coef >= 0, name, "router_aux_loss_coef", coef,
              "must be >= 0")
        # The layers run as one lax.scan over their stacked params (decoder.py), which
        # needs every layer alike: a dense MLP between sparse ones would break the stack.
        check(self.decoder_sparse_step == 1, name, "decoder_sparse_step",
              self.decoder_sparse_step, "only 1 (every layer sparse) is supported: the "
              "layers run as one scan, which needs every layer alike")
        check(self.mlp_only_layers == (), name, "mlp_only_layers", self.mlp_only_layers,
              "only [] (no dense layers) is supported: the layers run as one scan, which "
              "needs every layer alike")

    @property
    def qkv_bias(self) -> bool:
        """Qwen2/2.5 add biases to the q, k and v projections (never to o)."""
        return self.model_type == "qwen2"

    @property
    def qk_norm(self) -> bool:
        """Qwen3 RMS-normalises each head of q and k (over head_dim) before RoPE."""
        return self.model_type in ("qwen3", "qwen3_moe")

    @property
    def is_moe(self) -> bool:
        """Each layer's MLP is a mixture of experts (fnrl.models.moe), not one SwiGLU."""
        return self.model_type in MOE_FAMILIES

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """`eos_token_id` as a tuple, empty when unset."""
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

    def rope_inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies (head_dim/2,), float32, scaling applied; computed in
        float64 so the only rounding is the final cast."""
        d = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        s = self.rope_scaling
        if s is not None:
            wavelen = 2 * math.pi / inv_freq
            low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
            high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
            # 0 at the low-frequency edge (fully stretched), 1 at the high (kept).
            smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                      / (s.high_freq_factor - s.low_freq_factor))
            blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
            inv_freq = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor,
                                np.where(wavelen < high_freq_wavelen, inv_freq, blended))
        return inv_freq.astype(np.float32)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> DecoderConfig:
        """Builds a config from an HF `config.json` dict; keys that change nothing here
        are ignored, features fnrl lacks raise a ValueError naming their key."""
        missing = [k for k in _REQUIRED_HF_KEYS if k not in hf]
        if missing:
            raise ValueError(f"HF config is missing required keys: {missing}")
        model_type = hf.get("model_type") or _family_of_architectures(hf.get("architectures"))
        if model_type not in FAMILIES:
            raise ValueError(f"HF config model_type={model_type!r} is not supported "
                             f"(one of {FAMILIES})")
        _refuse_unsupported(hf, model_type)
        fields = {f.name for f in dataclasses.fields(cls)} - {"rope_scaling", "rope_theta"}
        if model_type not in MOE_FAMILIES:  # a dense config's stray MoE keys change nothing
            fields -= set(_MOE_DEFAULTS)
        kwargs = {k: v for k, v in hf.items() if k in fields}
        if model_type in MOE_FAMILIES:
            if "num_experts" not in kwargs and "num_local_experts" in hf:
                # transformers 5 writes Qwen3MoeConfig.num_experts as num_local_experts.
                kwargs["num_experts"] = hf["num_local_experts"]
            missing = [k for k in _MOE_REQUIRED_HF_KEYS if kwargs.get(k) is None]
            if missing:
                raise ValueError(f"HF config of model_type={model_type!r} is missing required "
                                 f"keys: {missing}")
        kwargs["model_type"] = model_type
        kwargs["rope_theta"], kwargs["rope_scaling"] = _read_rope(hf)
        if kwargs.get("num_key_value_heads") is None:
            kwargs["num_key_value_heads"] = hf["num_attention_heads"]
        if kwargs.get("head_dim") is None:
            kwargs.pop("head_dim", None)
        return cls(**kwargs)

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """Returns a complete HF `config.json` dict that transformers (4 and 5) and vLLM
        load as this family's architecture."""
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        scaling = None if self.rope_scaling is None else self.rope_scaling.to_hf()
        hf = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            # Both spellings: transformers>=5 reads rope_parameters, older readers
            # rope_theta and rope_scaling.
            "rope_theta": self.rope_theta,
            "rope_parameters": {**(scaling or {"rope_type": "default"}),
                                "rope_theta": self.rope_theta},
            "rope_scaling": scaling,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": dtype,
            "dtype": dtype,
        }
        if self.model_type in ("qwen2", "qwen3"):
            hf.update(use_sliding_window=False, sliding_window=None,
                      max_window_layers=self.num_hidden_layers,
                      layer_types=["full_attention"] * self.num_hidden_layers)
        if self.model_type in ("qwen3", "llama", "qwen3_moe"):
            hf["attention_bias"] = False
        if self.is_moe:
            # num_experts as the Hub's Qwen3-MoE configs spell it (transformers 5 reads it
            # through its attribute_map; vLLM and transformers 4 read it directly).
            hf.update({k: getattr(self, k) for k in _MOE_DEFAULTS})
            hf.update(use_sliding_window=False, sliding_window=None, output_router_logits=False,
                      mlp_only_layers=list(self.mlp_only_layers))
        if self.model_type == "llama":
            hf.update(mlp_bias=False, pretraining_tp=1)
        return hf


def _family_of_architectures(architectures) -> str:
    # Configs without model_type predate it; fnrl's own old exports were all Qwen2.
    if not architectures:
        return "qwen2"
    by_arch = {arch: family for family, arch in ARCHITECTURES.items()}
    return by_arch.get(architectures[0], architectures[0])


def _refuse_unsupported(hf: Mapping[str, Any], model_type: str) -> None:
    """Raises a ValueError naming the first key that asks for a feature fnrl lacks."""
    if hf.get("use_sliding_window"):
        raise ValueError("HF config use_sliding_window=True is not supported")
    layer_types = hf.get("layer_types") or ()
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"HF config layer_types={sorted(set(layer_types))} is not supported "
                         "(only full_attention)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"HF config hidden_act={hf['hidden_act']!r} is not supported (silu)")
    if hf.get("mlp_bias"):
        raise ValueError("HF config mlp_bias=True is not supported")
    if model_type != "qwen2" and hf.get("attention_bias"):
        raise ValueError(f"HF config attention_bias=True is not supported for {model_type}")
    if hf.get("shared_expert_intermediate_size"):  # vLLM's qwen3_moe would add one
        raise ValueError(f"HF config shared_expert_intermediate_size="
                         f"{hf['shared_expert_intermediate_size']} is not supported "
                         "(no shared expert)")
    if hf.get("pretraining_tp", 1) != 1:
        raise ValueError(f"HF config pretraining_tp={hf['pretraining_tp']} is not supported (1)")
    rope = hf.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        raise ValueError(f"HF config partial_rotary_factor={factor} is not supported (1.0)")


def _read_rope(hf: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, scaling) from transformers>=5 `rope_parameters` or the older
    top-level `rope_theta` plus `rope_scaling` (whose type key was once `type`)."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = dict(hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", DecoderConfig.rope_theta))
    rope = params if params.get("rope_type", params.get("type")) not in (None, "default") \
        else legacy or params
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(f"HF config rope_scaling/rope_parameters rope_type={rope_type!r} is "
                         "not supported (default RoPE or llama3)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in rope]
    if missing:
        raise ValueError(f"HF config llama3 RoPE scaling lacks {missing}")
    return float(theta), Llama3RopeScaling(
        factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
