"""fnrl's Qwen3-MoE against transformers' Qwen3MoeForCausalLM, in both directions: its
checkpoint in fnrl (logits, packing, the load-balancing loss), fnrl's export in it, and
the safetensors layout each writes."""

import json

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from fnrl.models.decoder import DecoderConfig, forward_with_router_stats, init_model
from fnrl.models.hf_io import (check_model_dir, hf_to_params, load_pretrained, params_to_hf,
                               save_pretrained)
from fnrl.models.moe import layer_stats, reduce_layer_stats, route
from fnrl.models.synthetic import random_params

# As tests/models/test_decoder_parity.py: weights larger than HF's init so logits are
# O(1) and 1e-4 is a ~1e-4 relative check; float32 differs only in summation order.
ATOL = 1e-4
SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
             num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
             bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
T = 20
_stats = jax.jit(forward_with_router_stats, static_argnums=0)


def _tokens(shape, seed=0):
    return np.random.default_rng(seed).integers(0, SMALL["vocab_size"], shape).astype(np.int32)


def _hf_run(model, tokens_1xT):
    """(logits T×V, router logits per layer, each T×X) of one unpadded row."""
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(np.asarray(tokens_1xT)).long(),
                    output_router_logits=True)
    return out.logits[0].numpy(), out.router_logits


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A random Qwen3MoeForCausalLM and the directory its save_pretrained wrote."""
    config = transformers.Qwen3MoeConfig(**SMALL, rope_parameters={"rope_type": "default",
                                                                   "rope_theta": 1e6})
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            std, mean = (0.2, 1.0) if "norm" in name else (0.15, 0.0)
            p.copy_(mean + std * torch.randn_like(p))
    path = tmp_path_factory.mktemp("hf_qwen3_moe")
    model.save_pretrained(path, safe_serialization=True)
    return model, path


def test_transformers_checkpoint_loads_with_same_logits_packing_and_aux_loss(hf_checkpoint):
    """Row 0 one sequence; row 1 two packed sequences and a padding tail, which the
    statistics' mask leaves out. transformers runs each sequence alone; its
    `load_balancing_loss_func` over their router logits pooled is fnrl's aux_loss."""
    hf_model, path = hf_checkpoint
    cfg, graphdef, params = load_pretrained(path)
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (
        "qwen3_moe", 8, 2, True)
    a, b, c = _tokens((T,), 1), _tokens((9,), 2), _tokens((7,), 3)
    pad = T - len(b) - len(c)
    tokens = np.stack([a, np.concatenate([b, c, np.zeros(pad, np.int32)])])
    segments = np.array([[1] * T, [1] * len(b) + [2] * len(c) + [0] * pad])
    positions = np.array([list(range(T)), [*range(len(b)), *range(len(c)), *[0] * pad]])
    logits, stats = _stats(graphdef, params, tokens, positions, segments, None, segments != 0)
    logits = np.asarray(logits)

    runs = [_hf_run(hf_model, s[None]) for s in (a, b, c)]
    assert np.abs(runs[0][0]).std() > 0.5   # the tolerance below is meaningful
    np.testing.assert_allclose(logits[0], runs[0][0], rtol=0, atol=ATOL)
    np.testing.assert_allclose(logits[1, :len(b)], runs[1][0], rtol=0, atol=ATOL)
    np.testing.assert_allclose(logits[1, len(b):T - pad], runs[2][0], rtol=0, atol=ATOL)
    pooled = tuple(torch.cat([run[1][layer] for run in runs])
                   for layer in range(cfg.num_hidden_layers))
    expected = load_balancing_loss_func(pooled, cfg.num_experts, cfg.num_experts_per_tok)
    assert float(expected) > 1.0   # X·Σ f·P is K at perfect balance
    np.testing.assert_allclose(float(stats["aux_loss"]), float(expected), rtol=1e-5)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_aux_loss_equals_transformers_load_balancing_loss_func(norm_topk_prob):
    """On the same random router logits of L layers, with and without a padding mask;
    the loss does not depend on norm_topk_prob, the routing weights do (checked against
    transformers' router arithmetic)."""
    L, N, X, K = 3, 40, 8, 2
    logits_LxNxX = np.random.default_rng(0).normal(0, 2, (L, N, X)).astype(np.float32)
    mask_N = (np.arange(N) < 31).astype(np.int32)
    for mask in (None, mask_N):
        probs = jax.nn.softmax(logits_LxNxX, axis=-1)
        per_layer = [layer_stats(p, route(p, K, norm_topk_prob)[0], None, mask) for p in probs]
        ours = reduce_layer_stats(jax.tree.map(lambda *xs: np.stack(xs), *per_layer), X)
        # HF's mask is B×T; one row of N tokens.
        hf_mask = None if mask is None else torch.from_numpy(mask)[None]
        theirs = load_balancing_loss_func(tuple(torch.from_numpy(x) for x in logits_LxNxX), X,
                                          K, hf_mask)
        np.testing.assert_allclose(float(ours["aux_loss"]), float(theirs), rtol=1e-6)
    ids, weights = route(probs[0], K, norm_topk_prob)
    top, hf_ids = torch.topk(torch.softmax(torch.from_numpy(logits_LxNxX[0]), -1), K)
    if norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    np.testing.assert_array_equal(ids, hf_ids.numpy())
    np.testing.assert_allclose(weights, top.numpy(), rtol=1e-6)


def test_fnrl_export_loads_in_transformers_with_same_logits(tmp_path):
    cfg = DecoderConfig(**SMALL, model_type="qwen3_moe", rope_theta=1e6)
    graphdef, _ = init_model(cfg, 0)
    params = random_params(cfg, 3, init_std=0.15, perturb_std=0.2)
    save_pretrained(tmp_path / "ckpt", cfg, params)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt", attn_implementation="eager", dtype=torch.float32).eval()
    assert type(hf_model).__name__ == "Qwen3MoeForCausalLM"
    assert (hf_model.config.num_experts, hf_model.config.norm_topk_prob) == (8, True)
    tokens = _tokens((1, T), seed=4)
    theirs = _hf_run(hf_model, tokens)[0]
    assert np.abs(theirs).std() > 0.5
    np.testing.assert_allclose(np.asarray(_stats(graphdef, params, tokens)[0][0]), theirs,
                               rtol=0, atol=ATOL)
    # The experts transformers fused on load are fnrl's, expert by expert.
    gate_up = hf_model.model.layers[1].mlp.experts.gate_up_proj.detach().numpy()
    np.testing.assert_array_equal(gate_up[5, :32].T, params["layers"][1]["moe"]["gate_kernel"][5])
    np.testing.assert_array_equal(gate_up[5, 32:].T, params["layers"][1]["moe"]["up_kernel"][5])


def test_layout_is_transformers_and_round_trips_bit_exact(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint
    cfg = DecoderConfig.from_hf(json.loads((path / "config.json").read_text()))
    with safe_open(path / "model.safetensors", "np") as f:
        theirs = {name: f.get_tensor(name) for name in f.keys()}
    ours = params_to_hf(cfg, hf_to_params(cfg, theirs))
    assert set(ours) == set(theirs)   # every per-expert name, and no other
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in ours
    for name, tensor in theirs.items():
        np.testing.assert_array_equal(ours[name], tensor, err_msg=name)
    # fnrl's own sharded save and load give back the same params, bit for bit.
    params = hf_to_params(cfg, theirs)
    save_pretrained(tmp_path / "sharded", cfg, params, max_shard_bytes=40_000)
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    _, _, loaded = load_pretrained(tmp_path / "sharded")
    jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_write_checkpoint_makes_a_complete_qwen3_moe(synthetic_model_dir):
    out = synthetic_model_dir("qwen3_moe")
    check_model_dir(out)
    cfg, _, params = load_pretrained(out)
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    hf_config = transformers.AutoConfig.from_pretrained(out)
    assert (hf_config.architectures, hf_config.num_experts) == (["Qwen3MoeForCausalLM"], 8)
    assert 0.015 < np.std(params["layers"][0]["moe"]["up_kernel"]) < 0.025  # HF's init range
