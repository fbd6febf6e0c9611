"""Equivalence of fnrl's decoder with transformers, per family, in both directions.

Qwen2 with q/k/v biases, Qwen3 with per-head q/k norms and an explicit head_dim, Llama 3
with llama3 RoPE scaling (and with plain RoPE); tied and untied embeddings.
"""

import dataclasses
import json

import jax
import numpy as np
import pytest
import torch
import transformers

from fnrl.models.decoder import DecoderConfig, forward, logical_axes
from fnrl.models.hf_io import (hf_to_params, init_model, load_pretrained, params_to_hf,
                               save_pretrained)
from fnrl.models.synthetic import random_params

# Weights are drawn larger than HF's 0.02 init so logits are O(1) and 1e-4 is a relative
# ~1e-4 check; float32 differences come only from summation order (measured ~4e-6).
ATOL = 1e-4
SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
# (HF config class, HF model class, config kwargs in transformers' own spelling)
VARIANTS = {
    "qwen2-tied": ("Qwen2", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen2-untied": ("Qwen2", dict(tie_word_embeddings=False)),
    "qwen2-head_dim8": ("Qwen2", dict(tie_word_embeddings=False, head_dim=8)),
    "qwen3-tied": ("Qwen3", dict(tie_word_embeddings=True, head_dim=32, rope_theta=1e6)),
    "qwen3-untied": ("Qwen3", dict(tie_word_embeddings=False, head_dim=8)),
    "llama3-scaled": ("Llama", dict(tie_word_embeddings=False, rope_theta=5e5, rms_norm_eps=1e-5,
                                    max_position_embeddings=512)),
    "llama-tied": ("Llama", dict(tie_word_embeddings=True, rope_theta=1e4)),
}
T = 40  # long enough that every llama3 frequency band rotates visibly


def _hf_config(variant):
    family, kwargs = VARIANTS[variant]
    kwargs = dict(kwargs)
    scaling = LLAMA3_ROPE if variant == "llama3-scaled" else {"rope_type": "default"}
    rope = {**scaling, "rope_theta": kwargs.pop("rope_theta", 1e4)}
    return getattr(transformers, f"{family}Config")(**SMALL, **kwargs, rope_parameters=rope)


def _hf_model(tmp_path, variant):
    family = VARIANTS[variant][0]
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(_hf_config(variant)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:  # includes q/k/v biases, which HF initialises to zero
                p.copy_(0.15 * torch.randn_like(p))
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


def _hf_logits(model, tokens_BxT):
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(np.asarray(tokens_BxT))).logits.numpy()


def _tokens(shape, seed=0):
    return np.random.default_rng(seed).integers(0, SMALL["vocab_size"], shape).astype(np.int32)


def _our_config(variant) -> DecoderConfig:
    return DecoderConfig.from_hf(_hf_config(variant).to_dict())


def _forward(graphdef, params, tokens_BxT):
    return np.asarray(jax.jit(forward, static_argnums=0)(graphdef, params, tokens_BxT))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_checkpoint_loads_with_same_logits(tmp_path, variant):
    hf_model = _hf_model(tmp_path, variant)
    cfg, graphdef, params = load_pretrained(tmp_path)
    family = VARIANTS[variant][0].lower()
    assert cfg.model_type == family
    assert cfg.tie_word_embeddings == VARIANTS[variant][1]["tie_word_embeddings"]
    assert ("lm_head" in params) != cfg.tie_word_embeddings
    assert ("q_bias" in params["layers"][0]["attn"]) == (family == "qwen2")
    assert ("q_norm" in params["layers"][0]["attn"]) == (family == "qwen3")
    assert (cfg.rope_scaling is not None) == (variant == "llama3-scaled")
    tokens_BxT = _tokens((3, T))
    ours_BxTxV = _forward(graphdef, params, tokens_BxT)
    theirs_BxTxV = _hf_logits(hf_model, tokens_BxT)
    assert ours_BxTxV.dtype == np.float32
    assert np.abs(theirs_BxTxV).std() > 0.5  # the tolerance below is meaningful
    np.testing.assert_allclose(ours_BxTxV, theirs_BxTxV, rtol=0, atol=ATOL)


def test_llama3_rope_scaling_changes_the_logits(tmp_path):
    """The scaled-RoPE parity above is not vacuous: plain RoPE gives other logits."""
    hf_model = _hf_model(tmp_path, "llama3-scaled")
    cfg, _, params = load_pretrained(tmp_path)
    graphdef, _ = init_model(dataclasses.replace(cfg, rope_scaling=None), 0)
    tokens_BxT = _tokens((1, T))
    assert np.abs(_forward(graphdef, params, tokens_BxT)
                  - _hf_logits(hf_model, tokens_BxT)).max() > 100 * ATOL


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_saved_checkpoint_loads_in_transformers(tmp_path, variant):
    cfg = _our_config(variant)
    graphdef, _ = init_model(cfg, 0)
    params = random_params(cfg, 3, init_std=0.15, perturb_std=0.2)
    save_pretrained(tmp_path / "ckpt", cfg, params)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt", attn_implementation="eager", dtype=torch.float32).eval()
    assert type(hf_model).__name__ == f"{VARIANTS[variant][0]}ForCausalLM"
    tokens_BxT = _tokens((2, T), seed=1)
    theirs_BxTxV = _hf_logits(hf_model, tokens_BxT)
    assert np.abs(theirs_BxTxV).std() > 0.5
    np.testing.assert_allclose(_forward(graphdef, params, tokens_BxT), theirs_BxTxV,
                               rtol=0, atol=ATOL)
    saved = json.loads((tmp_path / "ckpt" / "generation_config.json").read_text())
    assert saved == {"bos_token_id": 1, "eos_token_id": 2}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_params_hf_round_trip_is_bit_exact(variant):
    cfg = _our_config(variant)
    params = random_params(cfg, 5, init_std=0.15, perturb_std=0.2)
    tensors = params_to_hf(cfg, params)
    assert ("lm_head.weight" in tensors) != cfg.tie_word_embeddings
    assert all(t.flags.c_contiguous and t.dtype == np.float32 for t in tensors.values())
    # Exactly the tensor names transformers' own model of this family has.
    hf_names = {n for n, _ in getattr(transformers, f"{VARIANTS[variant][0]}ForCausalLM")(
        _hf_config(variant)).named_parameters()}
    assert set(tensors) == hf_names
    back = hf_to_params(cfg, tensors)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    jax.tree.map(np.testing.assert_array_equal, back, jax.tree.map(np.asarray, params))


@pytest.mark.slow   # compiles full steps: the whole suite's, not the inner loop's
def test_packed_segments_match_separate_runs():
    cfg = _our_config("qwen3-untied")
    graphdef, _ = init_model(cfg, 0)
    params = random_params(cfg, 7, init_std=0.15, perturb_std=0.2)
    a_T, b_T = _tokens((5,), seed=2), _tokens((4,), seed=3)
    pad = 3
    tokens_1xT = np.concatenate([a_T, b_T, np.zeros(pad, np.int32)])[None]
    segments_1xT = np.array([[1] * 5 + [2] * 4 + [0] * pad])
    positions_1xT = np.array([list(range(5)) + list(range(4)) + [0] * pad])
    packed_1xTxV = np.asarray(forward(graphdef, params, tokens_1xT, positions_1xT, segments_1xT))
    alone_a = np.asarray(forward(graphdef, params, a_T[None]))[0]
    alone_b = np.asarray(forward(graphdef, params, b_T[None]))[0]
    np.testing.assert_allclose(packed_1xTxV[0, :5], alone_a, rtol=0, atol=1e-5)
    np.testing.assert_allclose(packed_1xTxV[0, 5:9], alone_b, rtol=0, atol=1e-5)
    assert np.isfinite(packed_1xTxV).all()
    # Without segment ids the second sequence sees the first, so the mask is what matters.
    unmasked = np.asarray(forward(graphdef, params, tokens_1xT, positions_1xT))
    assert np.abs(unmasked[0, 5:9] - alone_b).max() > 1e-2


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_logical_axes_cover_every_param(family):
    cfg = DecoderConfig(**{**SMALL, "model_type": family, "tie_word_embeddings": False})
    _, params = init_model(cfg, 0)
    axes = logical_axes(cfg)
    ranks = jax.tree.map(lambda p, names: (p.ndim, len(names)), params, axes)
    assert all(a == b for a, b in jax.tree.leaves(ranks, is_leaf=lambda x: isinstance(x, tuple)))
    assert axes["embedding"] == ("vocab", "embed")
    assert axes["lm_head"] == ("embed", "vocab")
    attn = axes["layers"][1]["attn"]
    assert attn["q_kernel"] == ("embed", "heads", "head_dim")
    assert attn["k_kernel"] == ("embed", "kv_heads", "head_dim")
    assert attn["o_kernel"] == ("heads", "head_dim", "embed")
    assert ("k_bias" in attn) == (family == "qwen2")
    if family == "qwen3":
        assert attn["q_norm"]["scale"] == attn["k_norm"]["scale"] == ("norm",)
    assert axes["layers"][0]["mlp"]["down_kernel"] == ("mlp", "embed")
    assert axes["final_norm"]["scale"] == ("norm",)
