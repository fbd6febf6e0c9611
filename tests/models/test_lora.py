"""LoRA adapters: the model with adapters is the merged model, B = 0 is the base, the
gradient reaches the adapters alone, and the PEFT layout is what PEFT computes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnrl.config import LoraConfig
from fnrl.models.decoder import DecoderConfig, forward, init_model, logical_axes
from fnrl.models.lora import (SCALING_TENSOR, delta_change_norm, init_adapters, join, merge,
                              peft_tensors, split_adapters)
from fnrl.models.hf_io import params_to_hf
from fnrl.models.synthetic import SMALL_SHAPES, random_params
from tests.tolerances import assert_close

VOCAB = 97
LORA = LoraConfig(rank=4, alpha=8.0)


def _cfg(family):
    return DecoderConfig(**{**SMALL_SHAPES[family], "model_type": family, "vocab_size": VOCAB})


def _tokens(B=2, T=12, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (B, T)).astype(np.int32)


def _with_random_b(cfg, lora, seed):
    """Adapters whose B is not zero (a trained adapter), numpy."""
    adapters = init_adapters(cfg, lora, seed)
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: (rng.normal(0, 0.05, x.shape).astype(np.float32)
                         if str(path[-1].key).endswith("_lora_b") else x), adapters)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_adapters_equal_their_merged_model_and_zero_b_is_the_base(family):
    cfg = _cfg(family)
    base = jax.tree.map(np.asarray, random_params(cfg, 0, init_std=0.1))
    plain, _ = init_model(cfg, 0)
    graphdef, _ = init_model(cfg, 0, lora=LORA)
    tokens = _tokens()
    base_logits = forward(plain, base, tokens)
    fresh = join(init_adapters(cfg, LORA, seed=3), base)
    assert_close(forward(graphdef, fresh, tokens), base_logits)
    trained = join(_with_random_b(cfg, LORA, seed=1), base)
    lora_logits = forward(graphdef, trained, tokens)
    assert float(jnp.max(jnp.abs(lora_logits - base_logits))) > 1e-3   # the adapter acts
    assert_close(lora_logits, forward(plain, merge(trained, LORA), tokens))


def test_targets_by_name_leave_the_others_alone():
    cfg = _cfg("qwen2")
    lora = LoraConfig(rank=2, targets=("q_proj", "down_proj"))
    _, params = init_model(cfg, 0, lora=lora)
    adapters, frozen = split_adapters(params)
    assert sorted(adapters["layers"][0]["attn"]) == ["q_lora_a", "q_lora_b"]
    assert sorted(adapters["layers"][0]["mlp"]) == ["down_lora_a", "down_lora_b"]
    assert jax.tree.structure(join(adapters, frozen)) == jax.tree.structure(params)
    axes = logical_axes(cfg, lora)["layers"][1]["attn"]
    assert axes["q_lora_a"] == ("embed", "lora_rank")
    assert axes["q_lora_b"] == ("lora_rank", "heads", "head_dim")
    with pytest.raises(ValueError, match="targets"):
        LoraConfig(rank=2, targets=("qkv",))
    with pytest.raises(ValueError, match="rank"):
        LoraConfig(rank=-1)


@pytest.mark.slow   # compiles full steps: the whole suite's, not the inner loop's
def test_gradient_reaches_only_the_adapters_and_matches_the_merged_weights():
    cfg = _cfg("qwen2")
    base = jax.tree.map(np.asarray, random_params(cfg, 0, init_std=0.1))
    graphdef, _ = init_model(cfg, 0, lora=LORA)
    adapters = _with_random_b(cfg, LORA, seed=2)
    tokens = _tokens(seed=4)

    def loss(adapters):
        logits = forward(graphdef, join(adapters, base), tokens)
        return jax.nn.logsumexp(logits, axis=-1).mean()

    grads = jax.grad(loss)(adapters)
    assert jax.tree.structure(grads) == jax.tree.structure(adapters)
    # d loss / d A = s · x^T (dL/dy) B^T, checked against the merged weight's gradient:
    # dL/dW_merged chained through W = W0 + s·A·B.
    plain, _ = init_model(cfg, 0)
    merged_grads = jax.grad(lambda p: jax.nn.logsumexp(forward(plain, p, tokens), -1).mean())(
        merge(join(adapters, base), LORA))
    gw = np.asarray(merged_grads["layers"][0]["mlp"]["up_kernel"])
    a = adapters["layers"][0]["mlp"]["up_lora_a"]
    b = adapters["layers"][0]["mlp"]["up_lora_b"]
    assert_close(grads["layers"][0]["mlp"]["up_lora_a"], LORA.scaling * gw @ b.T)
    assert_close(grads["layers"][0]["mlp"]["up_lora_b"], LORA.scaling * a.T @ gw)


def test_peft_layout_merges_as_peft_does():
    """HF's merged weight is W + scaling · lora_B @ lora_A (PEFT's `get_delta_weight`)."""
    cfg = _cfg("qwen3")
    base = jax.tree.map(np.asarray, random_params(cfg, 0, init_std=0.1))
    adapters = _with_random_b(cfg, LORA, seed=5)
    peft = peft_tensors(cfg, LORA, adapters)
    assert peft[SCALING_TENSOR].tolist() == [LORA.scaling]
    hf_base, hf_merged = params_to_hf(cfg, base), params_to_hf(cfg, merge(join(adapters, base), LORA))
    for i in range(cfg.num_hidden_layers):
        for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                       "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            name = f"model.layers.{i}.{module}"
            a = peft[f"base_model.model.{name}.lora_A.weight"]
            b = peft[f"base_model.model.{name}.lora_B.weight"]
            assert a.shape[0] == LORA.rank and b.shape[1] == LORA.rank
            assert_close(hf_merged[name + ".weight"],
                         hf_base[name + ".weight"] + LORA.scaling * b @ a)


def test_delta_change_norm_is_the_merged_weights_change():
    cfg = _cfg("llama")
    old, new = _with_random_b(cfg, LORA, seed=6), _with_random_b(cfg, LORA, seed=7)
    base = jax.tree.map(np.asarray, random_params(cfg, 0, init_std=0.1))
    want = np.sqrt(sum(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2)
                       for x, y in zip(jax.tree.leaves(merge(join(new, base), LORA)),
                                       jax.tree.leaves(merge(join(old, base), LORA)))))
    assert want > 0
    np.testing.assert_allclose(float(delta_change_norm(old, new, LORA.scaling)), want, rtol=1e-4)
    assert float(delta_change_norm(old, old, LORA.scaling)) < 1e-3 * want
