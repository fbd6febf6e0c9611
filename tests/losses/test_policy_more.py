"""Golden values and closed-form gradients of CISPO, SAPO, GMPO and GPG on tiny inputs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnrl.losses.aggregation import with_weights
from fnrl.losses.policy import cispo_loss, gmpo_loss, gpg_loss, sapo_loss


def _batch(logp_BxT, ratios_BxT, adv_B, mask_BxT=None):
    """A batch whose behaviour log-probs give the ratios π/μ = ratios at logp."""
    logp = jnp.asarray(logp_BxT, jnp.float32)
    mu = logp - jnp.log(jnp.asarray(ratios_BxT, jnp.float32))
    mask = jnp.ones_like(logp) if mask_BxT is None else jnp.asarray(mask_BxT, jnp.float32)
    return {"mask_BxT": mask, "behaviour_logp_BxT": mu, "adv_B": jnp.asarray(adv_B, jnp.float32)}


def _grad(term, logp, batch, **kw):
    return jax.grad(lambda lp: term(lp, batch, **kw)[0])(logp)


LOGP = jnp.array([[-1.0, -2.0, -0.5]])


def test_cispo_clips_the_detached_weight_and_drops_no_token():
    batch = _batch(LOGP, [[5.0, 0.6, 1.0]], [2.0])
    # Weights min(r, 1 + 3) = 4, 0.6, 1 (no lower bound); loss mean(-w·A·log π).
    loss, m = cispo_loss(LOGP, batch, cispo_clip_low=1.0, cispo_clip_high=3.0)
    expected = -(4 * 2 * -1.0 + 0.6 * 2 * -2.0 + 1 * 2 * -0.5) / 3
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert float(m["clip_frac"]) == pytest.approx(1 / 3)
    # ∇ = -w·A/n on every token: the one above the cap keeps gradient (PPO would give 0).
    np.testing.assert_allclose(_grad(cispo_loss, LOGP, batch), [[-8 / 3, -1.2 / 3, -2 / 3]],
                               rtol=1e-5)
    # A lower bound 1 - 0.2 lifts the 0.6 weight to 0.8.
    np.testing.assert_allclose(_grad(cispo_loss, LOGP, batch, cispo_clip_low=0.2),
                               [[-8 / 3, -1.6 / 3, -2 / 3]], rtol=1e-5)


def _sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_sapo_soft_gate_golden():
    # On policy (r = 1): value -(4/τ)·σ(0)·A = -2A/τ, gradient exactly -A (plain PG).
    on = _batch([[-1.0]], [[1.0]], [1.0])
    loss, m = sapo_loss(jnp.array([[-1.0]]), on)
    assert float(loss) == pytest.approx(-2.0)
    np.testing.assert_allclose(_grad(sapo_loss, jnp.array([[-1.0]]), on), [[-1.0]], rtol=1e-6)
    assert float(m["grad_weight_mean"]) == pytest.approx(1.0)
    # A < 0, r = 1.5, τ_neg = 2: value (4/2)·σ(1), gradient -A·4σ(1)(1-σ(1))·1.5.
    off = _batch([[-1.0]], [[1.5]], [-1.0])
    loss, _ = sapo_loss(jnp.array([[-1.0]]), off, sapo_tau_pos=1.0, sapo_tau_neg=2.0)
    s = _sigmoid(1.0)
    assert float(loss) == pytest.approx(2 * s, rel=1e-6)
    grad = _grad(sapo_loss, jnp.array([[-1.0]]), off, sapo_tau_pos=1.0, sapo_tau_neg=2.0)
    np.testing.assert_allclose(grad, [[4 * s * (1 - s) * 1.5]], rtol=1e-5)
    # Far off policy the gradient fades smoothly instead of stopping at a hard edge.
    far = _batch([[-1.0]], [[6.0]], [1.0])
    assert 0 < -float(_grad(sapo_loss, jnp.array([[-1.0]]), far)[0, 0]) < 0.2


def test_gmpo_geometric_mean_clipped_in_log_space():
    # Seq 0 (A=+1): log ratios (0.1, 0.7) -> (0.1, 0.4 held) -> s = e^0.25.
    # Seq 1 (A=-1): log ratios (-0.7, 0.2) -> (-0.4 held, 0.2) -> s = e^-0.1.
    logp = jnp.array([[-1.0, -2.0], [-0.5, -1.5]])
    batch = with_weights(_batch(logp, np.exp([[0.1, 0.7], [-0.7, 0.2]]), [1.0, -1.0]),
                         "seq_mean_token_mean")
    kw = dict(gmpo_clip_low=0.4, gmpo_clip_high=0.4)
    loss, m = gmpo_loss(logp, batch, **kw)
    assert float(loss) == pytest.approx((-math.exp(0.25) + math.exp(-0.1)) / 2, rel=1e-5)
    assert float(m["clip_frac"]) == pytest.approx(0.5)
    # ∇ on an unclipped token: -A·s/(S·|o|); a held token gets none.
    np.testing.assert_allclose(_grad(gmpo_loss, logp, batch, **kw),
                               [[-math.exp(0.25) / 4, 0.0], [0.0, math.exp(-0.1) / 4]], rtol=1e-5)
    # A<0 sequence with log ratios 5, 5: s = e^5 = 148, held at the dual-clip floor 3.
    stale = _batch([[-1.0, -1.0]], np.exp([[5.0, 5.0]]), [-1.0])
    assert float(gmpo_loss(jnp.array([[-1.0, -1.0]]), stale)[0]) == pytest.approx(3.0)
    assert float(gmpo_loss(jnp.array([[-1.0, -1.0]]), stale, dual_clip_c=0.0)[0]) == pytest.approx(
        math.exp(5.0), rel=1e-5)


def test_gpg_is_plain_reinforce():
    batch = _batch(LOGP, [[5.0, 0.6, 1.0]], [0.5])   # ratios are ignored
    loss, _ = gpg_loss(LOGP, batch)
    assert float(loss) == pytest.approx(-0.5 * (-1.0 - 2.0 - 0.5) / 3, rel=1e-6)
    np.testing.assert_allclose(_grad(gpg_loss, LOGP, batch), np.full((1, 3), -0.5 / 3), rtol=1e-6)
    # A mismatch correction's weight multiplies the tokens.
    corrected = dict(batch, is_weight_BxT=jnp.array([[2.0, 1.0, 0.0]]))
    np.testing.assert_allclose(_grad(gpg_loss, LOGP, corrected), [[-1 / 3, -0.5 / 3, 0.0]],
                               rtol=1e-6)
