"""Every registered loss term and advantage estimator drives the real jitted train step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fnrl.config import ADVANTAGE_NAMES, POLICY_TERM_NAMES, AlgoConfig
from fnrl.losses import build_objective
from fnrl.losses.advantages import compute_advantages
from fnrl.models.decoder import DecoderConfig, init_model
from fnrl.trainer.step import init_state, make_optimizer, token_logprobs, train_step

# "value" is the critic's term (tests/losses/test_value.py runs it in the step).
POLICY_TERMS = list(POLICY_TERM_NAMES)


@pytest.fixture(scope="module")
def model():
    cfg = DecoderConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1)
    return init_model(cfg, seed=0)


def _batch(graphdef, params):
    # Two sequences of 3 response tokens after a 1-token prompt; μ = the model's own
    # log-probs, one token made stale (log π/μ = 3) to exercise the clipping paths.
    tokens = jnp.array([[1, 2, 3, 4], [1, 5, 6, 7]])
    batch = {"input_BxT": tokens[:, :3], "target_BxT": tokens[:, 1:],
             "mask_BxT": jnp.ones((2, 3)), "adv_B": jnp.array([1.0, -1.0])}
    logp = token_logprobs(graphdef, params, batch["input_BxT"], batch["target_BxT"])
    batch["behaviour_logp_BxT"] = logp.at[1, 2].add(-3.0)
    return batch, logp


def _run_step(model, algo):
    graphdef, params = model
    objective = build_objective(algo)
    optimizer = make_optimizer(algo)
    ref = params if "ref_logp_BxT" in objective.needs else None
    step = jax.jit(functools.partial(train_step, graphdef=graphdef, optimizer=optimizer,
                                     loss_fn=objective))
    batch, before = _batch(graphdef, params)
    state, metrics = step(init_state(params, optimizer), batch, ref)
    assert int(state.step) == 1 and float(metrics["update_skipped"]) == 0.0
    assert all(np.isfinite(np.asarray(v)).all() for v in metrics.values())
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), state.params, params)
    assert max(jax.tree.leaves(moved)) > 0
    after = token_logprobs(graphdef, state.params, batch["input_BxT"], batch["target_BxT"])
    return metrics, before, after


def test_every_term_in_one_jitted_step(model):
    """All built-in terms at once (one compilation): each traces, differentiates and
    reports finite metrics inside the real step, KL with its reference pass."""
    algo = AlgoConfig(learning_rate=1e-2, loss_terms=tuple((t, 0.1) for t in POLICY_TERMS),
                      kl_coef=0.05, entropy_coef=0.05)
    metrics, _, _ = _run_step(model, algo)
    for name in POLICY_TERMS + ["kl", "entropy"]:
        assert f"{name}/loss" in metrics, name


@pytest.mark.slow   # one compilation per term: minutes on a loaded 2-core machine
@pytest.mark.parametrize("name", POLICY_TERMS)
def test_each_policy_term_ascends_in_the_jitted_step(model, name):
    metrics, before, after = _run_step(
        model, AlgoConfig(learning_rate=1e-2, loss_terms=((name, 1.0),)))
    assert f"{name}/loss" in metrics
    # One step ascends the advantage-weighted log-likelihood (A = +1, -1).
    gap = lambda lp: float(jnp.sum(lp[0]) - jnp.sum(lp[1]))  # noqa: E731
    assert gap(after) > gap(before), name


@pytest.mark.parametrize("name", [n for n in ADVANTAGE_NAMES if n != "gae"])  # gae: in the step
def test_estimator_runs_from_the_config(name):
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, np.nan, 0.0]])
    lengths = np.array([[3, 5, 7, 9], [4, 4, 4, 4], [2, 2, 2, 2]])
    algo = AlgoConfig(advantage=name, pass_k=2)
    adv = compute_advantages(rewards, algo, lengths_GxN=lengths)
    assert adv.shape == rewards.shape and np.isfinite(adv).all()
    assert adv[2].tolist() == [0.0] * 4                       # no signal, invalid sample
    assert (adv[0, [0, 3]] > 0).all() and (adv[0, [1, 2]] < 0).all()


@pytest.mark.parametrize("kind", ["token_mask", "seq_mask"])
@pytest.mark.slow   # compiles full steps: the whole suite's, not the inner loop's
def test_rejection_masks_reach_every_term_of_the_real_step(model, kind):
    """A rejected token contributes no gradient to any term (policy, KL, entropy): with
    every token rejected the step's gradient is zero; with none rejected it is the
    uncorrected step's. (The masks used to narrow mask_BxT only, while every term summed
    with the aggregation weights built before: rejecting all and none gave one update.)"""
    graphdef, params = model
    batch, logp = _batch(graphdef, params)
    terms = (("ppo_clip", 1.0), ("gspo", 0.5), ("cispo", 0.5))

    def grads(behaviour_logp_BxT, correction):
        algo = AlgoConfig(learning_rate=1.0, loss_terms=terms, kl_coef=0.05,
                          entropy_coef=0.05, correction=correction)
        step = jax.jit(functools.partial(train_step, graphdef=graphdef,
                                         optimizer=optax.sgd(1.0), loss_fn=build_objective(algo)))
        state, metrics = step(init_state(params, optax.sgd(1.0)),
                              dict(batch, behaviour_logp_BxT=behaviour_logp_BxT), params)
        return jax.tree.map(lambda new, old: old - new, state.params, params), metrics

    # w = π/μ: 1 everywhere (μ = π) is inside [0.5, 2]; e^-5 everywhere is outside.
    none, _ = grads(logp, "none")
    kept, kept_metrics = grads(logp, kind)
    rejected, rejected_metrics = grads(logp + 5.0, kind)
    assert float(kept_metrics["correction/masked_frac"]) == 0.0
    assert float(rejected_metrics["correction/masked_frac"]) == 1.0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), kept, none)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(none)) > 1e-4
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(rejected))
