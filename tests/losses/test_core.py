import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnrl.losses.advantages import grpo_advantages
from fnrl.losses.core import ADVANTAGES, POLICY_LOSSES, token_mean
from fnrl.losses.policy import ppo_clip_loss


def test_grpo_advantages_golden():
    adv = grpo_advantages(np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]), eps=0.0 + 1e-6)
    np.testing.assert_allclose(adv[0], [1, -1, -1, 1], atol=1e-5)
    np.testing.assert_allclose(adv[1], [0, 0, 0, 0])  # zero-variance group: no signal
    assert ADVANTAGES["grpo"] is grpo_advantages


def test_token_mean_weighs_tokens_not_sequences():
    x = jnp.array([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert float(token_mean(x, mask)) == pytest.approx(7.0 / 4.0)


def _batch(behaviour, adv):
    behaviour = jnp.asarray(behaviour, jnp.float32)
    return {"mask_BxT": jnp.ones_like(behaviour), "behaviour_logp_BxT": behaviour,
            "adv_B": jnp.asarray(adv, jnp.float32)}


def test_grpo_clip_higher_golden():
    # ratios e^{0.5}=1.65 (clipped at 1.28 for A>0), e^{-0.5}=0.61 (clipped at 0.8 for A<0)
    logp = jnp.log(jnp.array([[1.0, 1.0]]))
    batch = _batch(jnp.log(jnp.array([[np.exp(-0.5), np.exp(0.5)]])), [1.0])
    loss, m = ppo_clip_loss(logp, batch, clip_low=0.2, clip_high=0.28)
    # token 1: min(1.6487*1, 1.28*1) = 1.28 ; token 2: min(0.6065, 0.8) = 0.6065
    assert float(loss) == pytest.approx(-(1.28 + np.exp(-0.5)) / 2, rel=1e-5)
    assert float(m["clip_frac"]) == pytest.approx(0.5)
    batch_neg = _batch(batch["behaviour_logp_BxT"], [-1.0])
    loss_neg, _ = ppo_clip_loss(logp, batch_neg, clip_low=0.2, clip_high=0.28)
    # A<0: -min(-r, -clip(r)) = max(r, clip(r)): token 1 -> 1.6487, token 2 -> 0.8
    assert float(loss_neg) == pytest.approx((np.exp(0.5) + 0.8) / 2, rel=1e-5)


def test_grpo_gradient_on_policy_is_minus_advantage():
    # On-policy (ratio 1, inside the clip range) d loss / d logp_t = -A / num_tokens.
    logp = jnp.array([[-1.0, -2.0, -0.5]])
    batch = _batch(logp, [0.7])
    grad = jax.grad(lambda lp: ppo_clip_loss(lp, batch)[0])(logp)
    np.testing.assert_allclose(grad, np.full((1, 3), -0.7 / 3), rtol=1e-6)


def test_registry_rejects_duplicates():
    from fnrl.losses.core import register
    with pytest.raises(ValueError, match="already registered"):
        register(POLICY_LOSSES, "grpo")(lambda *a: None)
