"""Golden values and closed-form gradients of the policy terms on tiny inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnrl.losses.correction import correct, mismatch_metrics
from fnrl.losses.policy import aipo_loss, decoupled_ppo_loss, gspo_loss, ppo_clip_loss


def _batch(behaviour_BxT, adv_B, mask_BxT=None):
    behaviour = jnp.asarray(behaviour_BxT, jnp.float32)
    mask = jnp.ones_like(behaviour) if mask_BxT is None else jnp.asarray(mask_BxT, jnp.float32)
    return {"mask_BxT": mask, "behaviour_logp_BxT": behaviour,
            "adv_B": jnp.asarray(adv_B, jnp.float32)}


# Ratios π/μ of 1.5, 0.6 and 1.0: logp = 0, μ = -log r.
RATIOS = np.array([[1.5, 0.6, 1.0]])
LOGP = jnp.zeros((1, 3))
MU = -np.log(RATIOS)


@pytest.mark.parametrize("adv,clip_low,clip_high,expected", [
    # A>0: min(r, clip(r)) -> 1.2 (clipped above), 0.6, 1.0
    (1.0, 0.2, 0.2, -(1.2 + 0.6 + 1.0) / 3),
    # clip-higher: the upper bound moves to 1.28
    (1.0, 0.2, 0.28, -(1.28 + 0.6 + 1.0) / 3),
    # A<0: -min(-r, -clip(r)) = max(r, clip(r)) -> 1.5, 0.8 (clipped below), 1.0
    (-1.0, 0.2, 0.28, (1.5 + 0.8 + 1.0) / 3),
])
def test_ppo_clip_golden(adv, clip_low, clip_high, expected):
    loss, m = ppo_clip_loss(LOGP, _batch(MU, [adv]), clip_low=clip_low, clip_high=clip_high)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert float(m["clip_frac"]) == pytest.approx(1 / 3)


def test_ppo_dual_clip_caps_negative_advantage_loss():
    mu = -np.log(np.array([[5.0, 2.0]]))
    logp = jnp.zeros((1, 2))
    loss, m = ppo_clip_loss(logp, _batch(mu, [-1.0]), dual_clip_c=3.0)
    # max(r, clip(r)) = 5 and 2; dual clip caps at c=3: per-token 3 and 2.
    assert float(loss) == pytest.approx((3.0 + 2.0) / 2, rel=1e-5)
    assert float(m["dual_clip_frac"]) == pytest.approx(0.5)
    # The dual-clipped token gets no gradient; the other gets -A·r / n = 2/2.
    grad = jax.grad(lambda lp: ppo_clip_loss(lp, _batch(mu, [-1.0]), dual_clip_c=3.0)[0])(logp)
    np.testing.assert_allclose(grad, [[0.0, 1.0]], rtol=1e-5)


def test_aipo_value_and_gradient_are_truncated_is():
    batch = _batch(MU, [2.0])
    loss, m = aipo_loss(LOGP, batch, aipo_rho=1.2)
    w = np.minimum(RATIOS, 1.2)
    assert float(loss) == pytest.approx(float(-(w * 2.0).mean()), rel=1e-5)
    assert float(m["truncated_frac"]) == pytest.approx(1 / 3)
    # d/dlogp_t = -min(r_t, ρ)·A / n: the token above ρ still gets gradient, weighted by ρ.
    grad = jax.grad(lambda lp: aipo_loss(lp, batch, aipo_rho=1.2)[0])(LOGP)
    np.testing.assert_allclose(grad, -w * 2.0 / 3, rtol=1e-5)
    # No lower bound and no sign dependence: A<0 flips the gradient, same weights.
    grad_neg = jax.grad(lambda lp: aipo_loss(lp, _batch(MU, [-2.0]), aipo_rho=1.2)[0])(LOGP)
    np.testing.assert_allclose(grad_neg, w * 2.0 / 3, rtol=1e-5)


def test_decoupled_ppo_weights_by_behaviour_and_clips_around_proximal():
    # π_prox/μ = 1.5, 0.6, 1.0; current π = π_prox·(1.5, 1, 1) -> clip only token 0.
    batch = dict(_batch(MU, [1.0]), old_logp_BxT=jnp.zeros((1, 3)))
    logp = jnp.log(jnp.array([[1.5, 1.0, 1.0]]))
    loss, m = decoupled_ppo_loss(logp, batch, clip_low=0.2, clip_high=0.2)
    expected = -(1.5 * 1.2 + 0.6 * 1.0 + 1.0 * 1.0) / 3
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert float(m["clip_frac"]) == pytest.approx(1 / 3)
    # Capping drops the token with π_prox/μ = 1.5 > 1.4.
    loss_cap, m_cap = decoupled_ppo_loss(logp, batch, clip_low=0.2, clip_high=0.2,
                                         behaviour_cap=1.4)
    assert float(loss_cap) == pytest.approx(-(0.6 + 1.0) / 3, rel=1e-5)
    assert float(m_cap["behaviour_capped_frac"]) == pytest.approx(1 / 3)


def test_decoupled_ppo_without_proximal_is_truncated_is_gradient():
    batch = _batch(MU, [1.0])
    grad = jax.grad(lambda lp: decoupled_ppo_loss(lp, batch)[0])(LOGP)
    np.testing.assert_allclose(grad, -RATIOS / 3, rtol=1e-5)


def test_gspo_uses_one_ratio_per_sequence():
    # Two sequences: log ratios (0.1, 0.3) -> s = e^0.2; (0, 0, 0 masked) -> s = 1.
    mu = jnp.array([[-0.1, -0.3, 0.0], [0.0, 0.0, 5.0]])
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    logp = jnp.zeros((2, 3))
    batch = _batch(mu, [1.0, -1.0], mask)
    loss, m = gspo_loss(logp, batch, gspo_clip_low=0.5, gspo_clip_high=0.5)
    s = np.exp(0.2)
    assert float(loss) == pytest.approx(-(2 * s - 2 * 1.0) / 4, rel=1e-5)
    # ∇ = -A·s/n on every token of the sequence (sg(s)·π/sg(π)); masked tokens get 0.
    grad = jax.grad(lambda lp: gspo_loss(lp, batch, gspo_clip_low=0.5, gspo_clip_high=0.5)[0])(logp)
    np.testing.assert_allclose(grad, [[-s / 4, -s / 4, 0], [1 / 4, 1 / 4, 0]], rtol=1e-5)
    # With GSPO's narrow range the first sequence (s = 1.22, A > 0) is clipped entirely.
    _, m = gspo_loss(logp, batch)
    assert float(m["clip_frac"]) == pytest.approx(0.5)


def test_token_and_sequence_tis_and_masking():
    mu = -np.log(np.array([[3.0, 0.5], [1.1, 1.0]]))
    batch = _batch(mu, [1.0, 1.0])
    old = jnp.zeros((2, 2))
    kw = dict(tis_cap=2.0, mask_low=0.6, mask_high=1.5)
    out, _ = correct(old, batch, kind="token_tis", **kw)
    np.testing.assert_allclose(out["is_weight_BxT"], [[2.0, 0.5], [1.1, 1.0]], rtol=1e-5)
    out, _ = correct(old, batch, kind="seq_tis", **kw)
    np.testing.assert_allclose(out["is_weight_BxT"], [[1.5, 1.5], [1.1, 1.1]], rtol=1e-5)
    out, m = correct(old, batch, kind="token_mask", **kw)
    np.testing.assert_array_equal(out["mask_BxT"], [[0, 0], [1, 1]])
    assert float(m["masked_frac"]) == pytest.approx(0.5)
    # Geometric means: sqrt(1.5) = 1.22 and sqrt(1.1): both kept; a tighter band drops one.
    out, _ = correct(old, batch, kind="seq_mask", **kw)
    np.testing.assert_array_equal(out["mask_BxT"], [[1, 1], [1, 1]])
    out, _ = correct(old, batch, kind="seq_mask", tis_cap=2.0, mask_low=0.9, mask_high=1.2)
    np.testing.assert_array_equal(out["mask_BxT"], [[0, 0], [1, 1]])
    # The corrected PPO term multiplies by the weight and clips around π_old.
    out, _ = correct(old, batch, kind="token_tis", **kw)
    grad = jax.grad(lambda lp: ppo_clip_loss(lp, out)[0])(old)
    np.testing.assert_allclose(grad, -np.array([[2.0, 0.5], [1.1, 1.0]]) / 4, rtol=1e-5)


def test_mismatch_metrics_golden():
    batch = _batch(MU, [1.0])
    m = mismatch_metrics(LOGP, batch)
    log_r = np.log(RATIOS)
    assert float(m["logp_abs_diff"]) == pytest.approx(np.abs(log_r).mean(), rel=1e-5)
    assert float(m["mismatch/kl_k3"]) == pytest.approx((RATIOS - 1 - log_r).mean(), rel=1e-5)
    assert float(m["mismatch/is_p50"]) == pytest.approx(1.0, rel=1e-5)
    assert float(m["mismatch/is_max"]) == pytest.approx(1.5, rel=1e-5)
    assert float(m["mismatch/is_min"]) == pytest.approx(0.6, rel=1e-5)
