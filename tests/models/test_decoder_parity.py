"""Equivalence of fnrl Qwen2 with transformers Qwen2ForCausalLM, both directions."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from fnrl.models.hf_io import (hf_to_params, init_model, load_pretrained, params_to_hf,
                               save_pretrained)
from fnrl.models.decoder import DecoderConfig, forward, logical_axes

# Weights are drawn larger than HF's 0.02 init so logits are O(1) and 1e-4 is a relative
# ~1e-4 check; float32 differences come only from summation order (measured ~4e-6).
ATOL = 1e-4
SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
             bos_token_id=1, eos_token_id=2)
VARIANTS = {
    "tied": dict(tie_word_embeddings=True),
    "untied": dict(tie_word_embeddings=False),
    "head_dim8": dict(tie_word_embeddings=False, head_dim=8),
}


def _hf_model(tmp_path, variant):
    hf_cfg = transformers.Qwen2Config(**SMALL, **VARIANTS[variant])
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(hf_cfg).eval()
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


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_checkpoint_loads_with_same_logits(tmp_path, variant):
    hf_model = _hf_model(tmp_path, variant)
    cfg, graphdef, params = load_pretrained(tmp_path)
    assert cfg.tie_word_embeddings == VARIANTS[variant]["tie_word_embeddings"]
    assert ("lm_head" in params) != cfg.tie_word_embeddings
    tokens_BxT = _tokens((3, 11))
    ours_BxTxV = np.asarray(jax.jit(forward, static_argnums=0)(graphdef, params, tokens_BxT))
    theirs_BxTxV = _hf_logits(hf_model, tokens_BxT)
    assert ours_BxTxV.dtype == np.float32
    assert np.abs(theirs_BxTxV).std() > 0.5  # the tolerance below is meaningful
    np.testing.assert_allclose(ours_BxTxV, theirs_BxTxV, rtol=0, atol=ATOL)


def _random_params(cfg, seed):
    graphdef, params = init_model(cfg, seed)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    # Perturb every leaf, so zero-initialised biases and unit norms are exercised too.
    leaves = [x + 0.15 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return graphdef, jax.tree.unflatten(treedef, leaves)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_saved_checkpoint_loads_in_transformers(tmp_path, variant):
    cfg = DecoderConfig(**SMALL, **VARIANTS[variant])
    graphdef, params = _random_params(cfg, seed=3)
    save_pretrained(tmp_path / "ckpt", cfg, params)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt", attn_implementation="eager", dtype=torch.float32).eval()
    tokens_BxT = _tokens((2, 9), seed=1)
    np.testing.assert_allclose(np.asarray(forward(graphdef, params, tokens_BxT)),
                               _hf_logits(hf_model, tokens_BxT), rtol=0, atol=ATOL)
    saved = json.loads((tmp_path / "ckpt" / "generation_config.json").read_text())
    assert saved == {"bos_token_id": 1, "eos_token_id": 2}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_params_hf_round_trip_is_bit_exact(variant):
    cfg = DecoderConfig(**SMALL, **VARIANTS[variant])
    _, params = _random_params(cfg, seed=5)
    tensors = params_to_hf(cfg, params)
    assert ("lm_head.weight" in tensors) != cfg.tie_word_embeddings
    assert all(t.flags.c_contiguous and t.dtype == np.float32 for t in tensors.values())
    back = hf_to_params(cfg, tensors)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    jax.tree.map(np.testing.assert_array_equal, back, jax.tree.map(np.asarray, params))


def test_packed_segments_match_separate_runs():
    cfg = DecoderConfig(**SMALL, tie_word_embeddings=False)
    graphdef, params = _random_params(cfg, seed=7)
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


def test_bfloat16_compute_tracks_float32():
    cfg = DecoderConfig(**SMALL, tie_word_embeddings=True)
    graphdef32, params = _random_params(cfg, seed=9)
    graphdef16, _ = init_model(cfg, 0, dtype=jnp.bfloat16)
    tokens_BxT = _tokens((2, 8), seed=4)
    ref = np.asarray(forward(graphdef32, params, tokens_BxT))
    low = np.asarray(forward(graphdef16, params, tokens_BxT))
    assert low.dtype == np.float32
    assert np.abs(low - ref).max() < 0.1 * np.abs(ref).max()


def test_sharded_and_bfloat16_checkpoints_load(tmp_path):
    cfg = DecoderConfig(**SMALL, tie_word_embeddings=False)
    _, params = _random_params(cfg, seed=11)
    save_pretrained(tmp_path / "bf16", cfg, params, dtype=jnp.bfloat16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _, _, loaded = load_pretrained(tmp_path / "bf16")
    np.testing.assert_allclose(loaded["lm_head"], params["lm_head"], rtol=1e-2, atol=1e-3)

    # Split the float32 checkpoint over two files with an index, as large HF models are.
    from safetensors.numpy import save_file
    tensors = params_to_hf(cfg, params)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    out = tmp_path / "sharded"
    out.mkdir()
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, out / file, metadata={"format": "pt"})
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(cfg.to_hf()))
    _, _, loaded = load_pretrained(out)
    jax.tree.map(np.testing.assert_array_equal, loaded, jax.tree.map(np.asarray, params))


def test_logical_axes_cover_every_param():
    cfg = DecoderConfig(**SMALL, tie_word_embeddings=False)
    _, params = init_model(cfg, 0)
    axes = logical_axes(cfg)
    ranks = jax.tree.map(lambda p, names: (p.ndim, len(names)), params, axes)
    assert all(a == b for a, b in jax.tree.leaves(ranks, is_leaf=lambda x: isinstance(x, tuple)))
    assert axes["embedding"] == ("vocab", "embed")
    assert axes["lm_head"] == ("embed", "vocab")
    assert axes["layers"][1]["attn"]["q_kernel"] == ("embed", "heads", "head_dim")
    assert axes["layers"][0]["attn"]["k_kernel"] == ("embed", "kv_heads", "head_dim")
    assert axes["layers"][0]["attn"]["o_kernel"] == ("heads", "head_dim", "embed")
    assert axes["layers"][0]["mlp"]["down_kernel"] == ("mlp", "embed")
    assert axes["final_norm"]["scale"] == ("norm",)
