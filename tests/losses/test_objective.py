"""The combinator: weighted sums, config-built objectives, needs and preparation."""

import jax.numpy as jnp
import pytest

from fnrl.config import AlgoConfig
from fnrl.losses import build_objective
from fnrl.losses.objective import Objective, as_objective
from fnrl.losses.policy import aipo_loss, ppo_clip_loss


def _batch():
    return {"mask_BxT": jnp.ones((2, 2)), "behaviour_logp_BxT": jnp.full((2, 2), -1.0),
            "adv_B": jnp.array([1.0, -0.5])}


def test_objective_is_the_weighted_sum_of_its_terms():
    logp = jnp.array([[-0.9, -1.2], [-1.0, -0.7]])
    a, _ = ppo_clip_loss(logp, _batch())
    b, _ = aipo_loss(logp, _batch())
    obj = Objective(terms=(("ppo_clip", 1.0, ppo_clip_loss), ("aipo", 0.25, aipo_loss)))
    loss, metrics = obj(logp, _batch())
    assert float(loss) == pytest.approx(float(a) + 0.25 * float(b), rel=1e-6)
    assert float(metrics["aipo/loss"]) == pytest.approx(float(b))
    assert "ppo_clip/clip_frac" in metrics and "aipo/truncated_frac" in metrics
    # A bare term keeps its own metric names.
    assert "clip_frac" in as_objective(ppo_clip_loss)(logp, _batch())[1]


def test_build_objective_from_config_binds_hyperparameters_and_needs():
    algo = AlgoConfig(loss_terms=(("aipo", 1.0),), aipo_rho=1.01, entropy_coef=0.01)
    obj = build_objective(algo)
    assert [n for n, _, _ in obj.terms] == ["aipo", "entropy"]
    assert obj.needs == {"entropy_BxT"}
    logp = jnp.zeros((2, 2))  # ratio e ≈ 2.72 > ρ=1.01 everywhere
    _, m = obj.terms[0][2](logp, _batch())
    assert float(m["truncated_frac"]) == 1.0
    assert build_objective(AlgoConfig()).needs == frozenset()  # no KL -> no reference pass
    assert build_objective(AlgoConfig(kl_coef=0.1)).needs == {"ref_logp_BxT"}
    kl_reward = build_objective(AlgoConfig(kl_coef=0.1, kl_in="reward"))
    assert kl_reward.needs == {"ref_logp_BxT"} and len(kl_reward.terms) == 1


def test_kl_in_reward_shapes_per_token_advantages():
    obj = build_objective(AlgoConfig(kl_coef=0.5, kl_in="reward", kl_estimator="k1"))
    batch = dict(_batch(), ref_logp_BxT=jnp.full((2, 2), -2.0))
    prepared, _ = obj.prepare(jnp.full((2, 2), -1.0), batch)  # k1 = 1 per token
    # A - 0.5·(KL to go): 2 tokens left, then 1.
    assert prepared["adv_BxT"].tolist() == [[0.0, 0.5], [-1.5, -1.0]]


def test_config_rejects_unknown_terms_and_direct_kl():
    with pytest.raises(ValueError, match=r"AlgoConfig.loss_terms='nope'"):
        AlgoConfig(loss_terms=(("nope", 1.0),))
    with pytest.raises(ValueError, match="kl_coef"):
        AlgoConfig(loss_terms=(("kl", 1.0),))
    with pytest.raises(ValueError, match=r"AlgoConfig.aggregation='mean'"):
        AlgoConfig(aggregation="mean")
