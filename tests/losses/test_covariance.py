"""Clip-Cov and KL-Cov (arXiv 2505.22617) and their token selection, on tiny inputs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnrl.losses.covariance import clip_cov_loss, covariance_BxT, kl_cov_loss, top_fraction

# Two sequences of two tokens, A = (2, -2). Means over tokens: A 0, log π -1.275, so
# cov = A·(log π + 1.275) = (2.35, -3.45) and (-0.55, -0.55): only token (0, 0) is in
# Clip-Cov's band (1, 5), and it is the largest.
LOGP = jnp.array([[-0.1, -3.0], [-1.0, -1.0]])
ADV = jnp.array([2.0, -2.0])


def _batch(mu_BxT=LOGP):
    return {"mask_BxT": jnp.ones((2, 2)), "behaviour_logp_BxT": jnp.asarray(mu_BxT),
            "adv_B": ADV}


def test_covariance_golden():
    np.testing.assert_allclose(covariance_BxT(LOGP, _batch()), [[2.35, -3.45], [-0.55, -0.55]],
                               rtol=1e-5)


def test_top_fraction_takes_the_largest_eligible_and_at_least_one():
    score = jnp.array([[3.0, 1.0, 3.0, 2.0]])
    mask = jnp.ones((1, 4))
    everyone = jnp.ones((1, 4), bool)
    np.testing.assert_array_equal(top_fraction(score, everyone, mask, 0.5), [[1, 0, 1, 0]])
    np.testing.assert_array_equal(top_fraction(score, everyone, mask, 0.25), [[1, 0, 0, 0]])
    np.testing.assert_array_equal(top_fraction(score, everyone, mask, 1e-4), [[1, 0, 0, 0]])
    some = jnp.array([[False, True, False, False]])
    np.testing.assert_array_equal(top_fraction(score, some, mask, 0.5), [[0, 1, 0, 0]])
    np.testing.assert_array_equal(top_fraction(score, some & False, mask, 0.5), [[0, 0, 0, 0]])


def test_clip_cov_detaches_the_high_covariance_token():
    batch = _batch()   # on policy: ratio 1, PPO clips nothing
    loss, m = clip_cov_loss(LOGP, batch)
    assert float(loss) == pytest.approx(0.0, abs=1e-6)   # -(2 + 2 - 2 - 2)/4: value kept
    assert float(m["cov_detached_frac"]) == pytest.approx(0.25)
    grad = jax.grad(lambda lp: clip_cov_loss(lp, batch)[0])(LOGP)
    np.testing.assert_allclose(grad, [[0.0, -0.5], [0.5, 0.5]], rtol=1e-5)
    # Outside the band nothing is detached: the plain PPO gradient -A/n.
    grad = jax.grad(lambda lp: clip_cov_loss(lp, batch, clip_cov_ub=2.0)[0])(LOGP)
    np.testing.assert_allclose(grad, [[-0.5, -0.5], [0.5, 0.5]], rtol=1e-5)


def test_kl_cov_penalises_the_high_covariance_token():
    # Token (0, 0) was sampled with log μ = log π - 0.1: ratio e^0.1, |log r| = 0.1.
    batch = _batch(LOGP.at[0, 0].add(-0.1))
    loss, m = kl_cov_loss(LOGP, batch, kl_cov_ratio=2e-3, kl_cov_coef=1.0)
    r = math.exp(0.1)
    assert float(loss) == pytest.approx((-2 * r + 0.1 - 2 + 2 + 2) / 4, rel=1e-5)
    assert float(m["cov_penalised_frac"]) == pytest.approx(0.25)
    grad = jax.grad(lambda lp: kl_cov_loss(lp, batch)[0])(LOGP)
    # -A·r/n everywhere, plus β·sign(log r)/n on the penalised token.
    np.testing.assert_allclose(grad, [[(-2 * r + 1) / 4, -0.5], [0.5, 0.5]], rtol=1e-5)
