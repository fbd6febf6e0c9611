"""The train step on a mixture of experts: its router's statistics every step, the
load-balancing loss as a loss term (`router_balance`), and the engine's routes replayed
when the batch carries them (`routes_BxTxLxK`, fnrl.models.moe)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnrl.config import AlgoConfig
from fnrl.losses import build_objective
from fnrl.models.decoder import DecoderConfig, forward_with_router_stats, init_model
from fnrl.trainer.step import init_state, make_optimizer, train_step
from tests.trainer.toy_batch import on_policy_batch

MOE = DecoderConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=64,
                    intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=16, norm_topk_prob=True)


def _batch(graphdef, params):
    return on_policy_batch(graphdef, params, rows=4, vocab=60, seed=0)


def _step(graphdef, params, batch, algo, micro_batches=1):
    opt = make_optimizer(algo)
    step = jax.jit(lambda s, b: train_step(s, b, graphdef=graphdef, optimizer=opt,
                                           loss_fn=build_objective(algo),
                                           micro_batches=micro_batches))
    return jax.device_get(step(init_state(params, opt), batch)[1])


@pytest.mark.slow   # compiles two full steps and three forward passes: the whole suite's
def test_the_balance_term_and_the_router_statistics_are_the_forward_passes():
    graphdef, params = init_model(MOE, 0)
    batch = _batch(graphdef, params)
    algo = AlgoConfig(loss_terms=(("grpo", 1.0), ("router_balance", 0.01)))
    m = _step(graphdef, params, batch, algo)
    stats_of = jax.jit(lambda tokens: forward_with_router_stats(graphdef, params, tokens)[1])
    stats = stats_of(batch["input_BxT"])
    # One micro-batch holds every token: the term is the forward pass's loss itself.
    np.testing.assert_allclose(m["router/aux_loss"], stats["aux_loss"], rtol=1e-5)
    np.testing.assert_allclose(m["router_balance/loss"], stats["aux_loss"], rtol=1e-5)
    assert m["router/aux_loss"] > 0   # X·Σ f·P: top-k (here 2) when perfectly balanced
    assert m["router/route_disagreement"] == 0.0   # nothing replayed
    np.testing.assert_allclose(m["loss"], m["grpo/loss"] + 0.01 * m["router_balance/loss"],
                               rtol=1e-5)
    # Two micro-batches: each term scaled by its share of the tokens, summed.
    m2 = _step(graphdef, params, batch, algo, micro_batches=2)
    halves = [stats_of(batch["input_BxT"][i::2])["aux_loss"] for i in (0, 1)]
    tokens = [batch["mask_BxT"][i::2].sum() for i in (0, 1)]
    np.testing.assert_allclose(m2["router_balance/loss"],
                               np.dot(halves, tokens) / sum(tokens), rtol=1e-5)


def test_replayed_routes_are_what_the_step_trains_through():
    graphdef, params = init_model(MOE, 0)
    batch = _batch(graphdef, params)
    algo = AlgoConfig(loss_terms=(("grpo", 1.0),))
    from flax import nnx

    own = np.asarray(jax.jit(lambda t: nnx.merge(graphdef, params).router_routes(t))(
        jnp.asarray(batch["input_BxT"])))
    base = _step(graphdef, params, batch, algo)
    same = _step(graphdef, params, {**batch, "routes_BxTxLxK": own}, algo)
    # The router's own routes replayed: the very same step.
    np.testing.assert_allclose(same["grpo/loss"], base["grpo/loss"], rtol=1e-6)
    assert same["router/route_disagreement"] == 0.0
    # Every token of the first row routed, in the last layer, to the two experts its
    # router did not pick (four experts, top-2: the complement). The last, so the router
    # sees the inputs it saw unreplayed (a replay in an earlier layer moves the later
    # layers' own choices): 1 row of 4, 1 layer of 2, both routes: 1/8 differ.
    crafted = own.copy()
    for t in range(own.shape[1]):
        crafted[0, t, -1] = sorted(set(range(4)) - set(own[0, t, -1]))
    moved = _step(graphdef, params, {**batch, "routes_BxTxLxK": crafted}, algo)
    np.testing.assert_allclose(moved["router/route_disagreement"], 1 / 8, rtol=1e-6)
    assert abs(moved["grpo/loss"] - base["grpo/loss"]) > 1e-6


def test_the_balance_term_on_a_dense_model_is_refused():
    dense = DecoderConfig(vocab_size=64, hidden_size=64, intermediate_size=64,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    graphdef, params = init_model(dense, 0)
    algo = AlgoConfig(loss_terms=(("grpo", 1.0), ("router_balance", 0.01)))
    with pytest.raises(ValueError, match="router_balance term needs a mixture-of-experts"):
        _step(graphdef, params, _batch(graphdef, params), algo)
