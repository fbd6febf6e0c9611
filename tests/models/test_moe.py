"""fnrl's mixture of experts (fnrl.models.moe) on its own: the ragged-dot dispatch
against a dense reference, routing replay, router statistics, sharded experts and the
config's refusals. Parity with transformers is tests/models/test_moe_hf.py's."""

import contextlib
import dataclasses
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from fnrl.config.lora import LoraConfig
from fnrl.models.decoder import (REMAT_POLICIES, DecoderConfig, abstract_model, forward,
                                 forward_with_router_stats, init_model, logical_axes,
                                 router_routes)
from fnrl.models.moe import EXPERT_OUTS, expert_ffn
from fnrl.models.synthetic import SMALL_SHAPES, random_params
from fnrl.sharding.mesh import make_mesh, partition_specs, shardings_for
from tests.tolerances import assert_close

CFG = DecoderConfig(**SMALL_SHAPES["qwen3_moe"], model_type="qwen3_moe", vocab_size=97)
L, K, X = CFG.num_hidden_layers, CFG.num_experts_per_tok, CFG.num_experts
B, T = 2, 12   # one batch shape for the module's tests, so they share compiled functions
# Jitted once for the module: eager dispatch of every op costs more than compiling.
_stats = jax.jit(forward_with_router_stats, static_argnums=0)
_routes = jax.jit(router_routes, static_argnums=0)


def _tokens(shape, seed=0):
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, shape).astype(np.int32)


@pytest.fixture(scope="module")
def model():
    graphdef, _ = init_model(CFG, 0)
    # Large weights: peaked routers, O(1) logits.
    return graphdef, random_params(CFG, 1, init_std=0.15, perturb_std=0.2)


def _dense_reference(x_NxE, ids_NxK, weights_NxK, gate_XxExI, up_XxExI, down_XxIxE):
    """Every expert on every token, combined by a one-hot mask of the chosen ones."""
    h_XxNxI = jax.nn.silu(jnp.einsum("ne,xei->xni", x_NxE, gate_XxExI)) * jnp.einsum(
        "ne,xei->xni", x_NxE, up_XxExI)
    out_XxNxE = jnp.einsum("xni,xie->xne", h_XxNxI, down_XxIxE)
    combine_NxX = jnp.einsum("nk,nkx->nx", weights_NxK,
                             jax.nn.one_hot(ids_NxK, gate_XxExI.shape[0]))
    return jnp.einsum("nx,xne->ne", combine_NxX, out_XxNxE)


def _dispatch_inputs(N=23, E=16, I=8):
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (N, E))
    kernels = [jax.random.normal(keys[1], (X, E, I)) * 0.3,
               jax.random.normal(keys[2], (X, E, I)) * 0.3,
               jax.random.normal(keys[3], (X, I, E)) * 0.3]
    # Distinct experts per token; expert 5 gets none, so an empty group is exercised.
    ids = np.stack([np.random.default_rng(n).choice([0, 1, 2, 3, 4, 6, 7], K, replace=False)
                    for n in range(N)]).astype(np.int32)
    weights = jax.random.uniform(keys[4], (N, K))
    return x, ids, weights, kernels


@pytest.mark.gpu   # ragged_dot is a grouped GEMM there, a loop here: one test for both
def test_ragged_dispatch_equals_dense_reference_in_values_and_gradients():
    x, ids, weights, kernels = _dispatch_inputs()
    args = (x, ids, weights, *kernels)
    ours, ref = jax.jit(expert_ffn)(*args), jax.jit(_dense_reference)(*args)
    assert float(jnp.abs(ref).mean()) > 0.1
    assert_close(ours, ref, "float32", precision="default")

    def loss(fn):
        return lambda x, w, g, u, d: jnp.sum(jnp.sin(fn(x, ids, w, g, u, d)))
    argnums = (0, 1, 2, 3, 4)
    grads = jax.jit(jax.grad(loss(expert_ffn), argnums))(x, weights, *kernels)
    ref_grads = jax.jit(jax.grad(loss(_dense_reference), argnums))(x, weights, *kernels)
    for g, r in zip(grads, ref_grads):
        assert float(jnp.abs(r).max()) > 0
        assert_close(g, r, "float32", precision="default")


@pytest.mark.parametrize("remat,saved", [("dots", set(EXPERT_OUTS)), ("full", set())])
def test_dots_remat_keeps_the_expert_matmuls(remat, saved):
    """ragged_dot is no dot_general: the "dots" policy keeps the experts' outputs by
    name, so the backward pass does not run them again."""
    x, ids, weights, kernels = _dispatch_inputs()
    fn = jax.checkpoint(lambda x, w, *k: jnp.sum(expert_ffn(x, ids, w, *k)),
                        policy=REMAT_POLICIES[remat]())
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        jax.ad_checkpoint.print_saved_residuals(fn, x, weights, *kernels)
    assert {name for name in EXPERT_OUTS if f"named '{name}'" in printed.getvalue()} == saved


@pytest.mark.parametrize("remat", ["none", "full"])
def test_replaying_the_model_s_own_routes_changes_nothing(model, remat):
    """In the Python loop over layers and in the remat scan over them (compared with
    the loop's own routing)."""
    graphdef, params = model
    tokens = _tokens((B, T))
    routes = _routes(graphdef, params, tokens)
    assert routes.shape == (B, T, L, K) and routes.dtype == jnp.int32
    logits, stats = _stats(graphdef, params, tokens)
    if remat != "none":
        graphdef, _ = abstract_model(CFG, remat=remat)
    # Reversed order within each token: the replayed set, not its order, matters.
    replayed, replayed_stats = _stats(graphdef, params, tokens, None, None, routes[..., ::-1])
    np.testing.assert_allclose(replayed, logits, rtol=0, atol=1e-5)
    assert float(replayed_stats["route_disagreement"]) == 0.0
    np.testing.assert_allclose(replayed_stats["aux_loss"], stats["aux_loss"], rtol=1e-6)


def test_replayed_routes_that_differ_change_those_tokens_and_count_exactly(model):
    graphdef, params = model
    tokens = _tokens((B, T), seed=1)
    routes = np.array(_routes(graphdef, params, tokens))
    # The last layer only: the layers before keep their own routing, so the router's
    # own choice there is unchanged and the disagreement is exactly what is crafted.
    changed = [(0, 1), (0, 7), (1, 0), (1, 4), (1, 11)]
    for b, t in changed:
        own = routes[b, t, L - 1]
        routes[b, t, L - 1, 1] = next(e for e in range(X) if e not in own)
    logits = np.asarray(_stats(graphdef, params, tokens)[0])
    replayed, stats = _stats(graphdef, params, tokens, None, None, routes)
    expected = len(changed) / (B * T * K) / L   # one of K routes, in one of L layers
    assert float(stats["route_disagreement"]) == pytest.approx(expected, rel=1e-6)
    moved_BxT = np.abs(np.asarray(replayed) - logits).max(axis=-1) > 1e-3
    assert {tuple(bt) for bt in np.argwhere(moved_BxT)} == set(changed)
    # Masking statistics to row 1 counts its three changes among its own tokens only.
    mask = np.array([[0] * T, [1] * T], np.int32)
    _, masked = _stats(graphdef, params, tokens, None, None, routes, mask)
    assert float(masked["route_disagreement"]) == pytest.approx(3 / (T * K) / L, rel=1e-6)

    # The router still learns from the logits under replay: its probabilities weight
    # the replayed experts (the last layer's router reaches the logits no other way).
    def loss(p):
        return jnp.mean(forward(graphdef, p, tokens, None, None, routes) ** 2)
    router_grad = jax.jit(jax.grad(loss))(params)["layers"][L - 1]["moe"]["router_kernel"]
    assert float(jnp.abs(router_grad).max()) > 1e-4


def test_dense_models_report_zero_statistics_and_refuse_routes():
    cfg = DecoderConfig(**SMALL_SHAPES["qwen3"], vocab_size=97, model_type="qwen3")
    graphdef, params = init_model(cfg, 0)
    tokens = _tokens((B, T))
    logits, stats = _stats(graphdef, params, tokens)
    assert logits.shape == (B, T, 97)
    assert {k: float(v) for k, v in stats.items()} == {"aux_loss": 0.0, "route_disagreement": 0.0}
    with pytest.raises(ValueError, match="dense model"):
        forward(graphdef, params, tokens, None, None, np.zeros((B, T, 2, 2), np.int32))
    with pytest.raises(ValueError, match="dense model"):
        router_routes(graphdef, params, tokens)


def test_routes_of_the_wrong_shape_are_refused(model):
    graphdef, params = model
    with pytest.raises(ValueError, match=r"has shape \(1, 6, 2, 3\).*\(1, 6, 2, 2\)"):
        forward(graphdef, params, _tokens((1, 6)), None, None, np.zeros((1, 6, L, 3), np.int32))


def test_expert_kernels_split_by_whole_experts():
    _, params = init_model(CFG, 0)
    specs = partition_specs(logical_axes(CFG), params, make_mesh(data=1, fsdp=4, tensor=2))
    # Whole experts over fsdp (the embed dimension left whole), their width over tensor.
    assert specs["layers/0/moe/gate_kernel"] == str(P("fsdp", None, "tensor"))
    assert specs["layers/0/moe/down_kernel"] == str(P("fsdp", "tensor", None))
    assert specs["layers/0/moe/router_kernel"] == str(P("fsdp", None))
    # 3 experts do not divide over 2: the embed dimension takes fsdp instead.
    cfg3 = dataclasses.replace(CFG, num_experts=3)
    _, params3 = abstract_model(cfg3)
    specs3 = partition_specs(logical_axes(cfg3), nnx.to_pure_dict(params3),
                             make_mesh(data=2, fsdp=2, tensor=2))
    assert specs3["layers/0/moe/up_kernel"] == str(P(None, "fsdp", "tensor"))


def test_experts_sharded_over_8_devices_equal_one_device(model):
    """A train-step-like gradient (logits and aux loss) under replay, sharded and not."""
    graphdef, params = model
    assert jax.device_count() == 8  # tests/conftest.py's fake CPU devices
    # One expert per device (fsdp only: tensor as well triples the compile time).
    mesh = make_mesh(data=1, fsdp=8, tensor=1)
    sharded = jax.device_put(params, shardings_for(logical_axes(CFG), params, mesh))
    up = sharded["layers"][1]["moe"]["up_kernel"]
    assert {shard.data.shape for shard in up.addressable_shards} == {(1, 64, 32)}
    tokens = _tokens((B, T), seed=2)
    routes = _routes(graphdef, params, tokens)
    mask = np.ones((B, T), np.int32)
    mask[1, 8:] = 0

    def loss(p):
        logits, stats = forward_with_router_stats(graphdef, p, tokens, None, None, routes, mask)
        return jnp.mean(logits ** 2) + stats["aux_loss"], (logits, stats)
    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (value, (logits, stats)), grads = step(params)
    (value_s, (logits_s, stats_s)), grads_s = step(sharded)
    assert grads_s["layers"][0]["moe"]["gate_kernel"].sharding.spec[0] == "fsdp"
    np.testing.assert_allclose(logits_s, logits, rtol=0, atol=1e-5)
    np.testing.assert_allclose(stats_s["aux_loss"], stats["aux_loss"], rtol=1e-6)
    np.testing.assert_allclose(value_s, value, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 grads_s, grads)


def test_logical_axes_of_the_experts():
    axes = logical_axes(CFG)
    moe = axes["layers"][0]["moe"]
    assert moe == {"router_kernel": ("embed", "expert"),
                   "gate_kernel": ("expert", "embed", "mlp"),
                   "up_kernel": ("expert", "embed", "mlp"),
                   "down_kernel": ("expert", "mlp", "embed")}
    assert "mlp" not in axes["layers"][0]
    _, params = init_model(CFG, 0)
    assert params["layers"][1]["moe"]["gate_kernel"].shape == (X, 64, 32)


@pytest.mark.parametrize("key,value", [("decoder_sparse_step", 2), ("mlp_only_layers", [0]),
                                       ("decoder_sparse_step", 0)])
def test_layers_not_all_sparse_are_refused_naming_the_key(key, value):
    hf = {**{k: v for k, v in CFG.to_hf().items()}, key: value}
    with pytest.raises(ValueError, match=f"{key}=.*every layer alike"):
        DecoderConfig.from_hf(hf)


@pytest.mark.parametrize("fields,key", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(num_experts=0), "num_experts"),
    (dict(moe_intermediate_size=None), "moe_intermediate_size"),
    (dict(norm_topk_prob=1), "norm_topk_prob"),
    (dict(router_aux_loss_coef=-1.0), "router_aux_loss_coef"),
])
def test_bad_moe_fields_are_refused_naming_the_field(fields, key):
    with pytest.raises(ValueError, match=f"DecoderConfig.{key}="):
        dataclasses.replace(CFG, **fields)


def test_moe_fields_belong_to_moe_families_only():
    dense = {**SMALL_SHAPES["qwen3"], "vocab_size": 97, "model_type": "qwen3"}
    with pytest.raises(ValueError, match="DecoderConfig.num_experts=8: is a mixture-of-experts"):
        DecoderConfig(**dense, num_experts=8)
    # A dense config.json's stray MoE keys are ignored, as before.
    cfg = DecoderConfig.from_hf({**DecoderConfig(**dense).to_hf(), "num_experts": 8})
    assert not cfg.is_moe and cfg.num_experts is None
    assert CFG.is_moe and CFG.qk_norm and not CFG.qkv_bias


def test_from_hf_reads_transformers_5_spelling_and_refuses_shared_experts():
    hf = CFG.to_hf()
    assert hf["architectures"] == ["Qwen3MoeForCausalLM"] and hf["num_experts"] == X
    renamed = {k: v for k, v in hf.items() if k != "num_experts"} | {"num_local_experts": X}
    assert DecoderConfig.from_hf(renamed) == CFG
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=64"):
        DecoderConfig.from_hf({**hf, "shared_expert_intermediate_size": 64})


def test_lora_on_the_experts_is_refused():
    with pytest.raises(ValueError, match=r"lora.targets=.*\['gate_proj', 'up_proj', 'down_proj'\]"):
        abstract_model(CFG, lora=LoraConfig(rank=4))
    _, state = abstract_model(CFG, lora=LoraConfig(rank=4, targets=("q_proj", "v_proj")))
    assert "q_lora_a" in nnx.to_pure_dict(state)["layers"][0]["attn"]


def test_from_hf_names_missing_expert_keys():
    hf = {k: v for k, v in CFG.to_hf().items() if k != "moe_intermediate_size"}
    with pytest.raises(ValueError, match=r"'qwen3_moe' is missing .*moe_intermediate_size"):
        DecoderConfig.from_hf(hf)
