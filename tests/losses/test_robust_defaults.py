"""Issue 15: with the default config no term lets one stale token blow up the loss.

A token sampled long ago can have log(π/μ) = 20. Under PPO clip with A < 0 the loss
and gradient were e^20·|A| ≈ 4.9·10^8 (dual clip off); at a log ratio of 100 exp
overflowed to inf and the whole step was skipped.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnrl.config import AlgoConfig, POLICY_TERM_NAMES
from fnrl.losses import build_objective
from fnrl.losses.objective import bind_term
from fnrl.losses.policy import ppo_clip_loss

RATIO_TERMS = list(POLICY_TERM_NAMES)


def _stale(log_ratio, adv=-1.0):
    logp = jnp.array([[-1.0, -1.5]])
    mu = logp.at[0, 0].add(-log_ratio)     # token 0 stale, token 1 on policy
    return logp, {"mask_BxT": jnp.ones((1, 2)), "behaviour_logp_BxT": mu,
                  "adv_B": jnp.array([adv])}


def test_ppo_default_bounds_the_stale_negative_token():
    logp, batch = _stale(20.0)
    objective = build_objective(AlgoConfig())
    loss, metrics = objective(logp, batch)
    # Token 0: dual clip at c·|A| = 3; token 1: r = 1 -> 1·|A|. Mean over 2 tokens.
    assert float(loss) == pytest.approx((3.0 + 1.0) / 2, rel=1e-6)
    assert float(metrics["ppo_clip/dual_clip_frac"]) == pytest.approx(0.5)
    grad = jax.grad(lambda lp: objective(lp, batch)[0])(logp)
    np.testing.assert_allclose(grad, [[0.0, 0.5]], rtol=1e-6)
    # The old default (dual clip off) is the e^20·|A| of the issue.
    old, _ = ppo_clip_loss(logp, batch, dual_clip_c=0.0)
    assert float(old) == pytest.approx((math.exp(20.0) + 1.0) / 2, rel=1e-5)


@pytest.mark.parametrize("name", RATIO_TERMS)
@pytest.mark.parametrize("log_ratio", [20.0, 100.0, -100.0])
@pytest.mark.parametrize("adv", [-1.0, 1.0])
def test_every_term_is_finite_and_bounded_on_a_stale_token(name, log_ratio, adv):
    logp, batch = _stale(log_ratio, adv)
    term = bind_term(name, AlgoConfig())
    loss, metrics = term(logp, batch)
    grad = jax.grad(lambda lp: term(lp, batch)[0])(logp)
    assert np.isfinite(float(loss)) and np.isfinite(np.asarray(grad)).all()
    # A few |A| at most (KL-Cov adds its |log r| ≤ 20 penalty to the value only).
    assert abs(float(loss)) <= 5.0 + 20.0 * (name == "kl_cov")
    assert np.abs(np.asarray(grad)).max() <= 5.0
    assert all(np.isfinite(float(v)) for v in metrics.values())
