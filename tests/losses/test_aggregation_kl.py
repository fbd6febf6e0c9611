"""Aggregation modes, KL estimators, KL-to-go and the entropy term on tiny inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnrl.losses.aggregation import with_weights
from fnrl.losses.core import aggregate
from fnrl.losses.kl import entropy_loss, kl_BxT, kl_loss, kl_to_go

X = jnp.array([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
MASK = jnp.array([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize("mode,expected", [
    ("token_mean", (1 + 2 + 3 + 4) / 4),
    ("seq_mean_token_mean", ((1 + 2 + 3) / 3 + 4 / 1) / 2),
    ("seq_mean_token_sum", ((1 + 2 + 3) + 4) / 2),
    ("constant", (1 + 2 + 3 + 4) / (2 * 8)),   # Dr.GRPO, norm_len 8
])
def test_aggregation_golden(mode, expected):
    batch = with_weights({"mask_BxT": MASK}, mode, norm_len=8)
    assert float(aggregate(X, batch)) == pytest.approx(expected)


def test_aggregation_packed_rows_count_sequences_not_rows():
    # One row holding two sequences (segments 1 and 2) = the two rows above.
    x = jnp.array([[1.0, 2.0, 3.0, 4.0]])
    batch = {"mask_BxT": jnp.ones((1, 4)), "segment_ids_BxT": jnp.array([[1, 1, 1, 2]])}
    batch = with_weights(batch, "seq_mean_token_mean")
    assert float(aggregate(x, batch)) == pytest.approx(((1 + 2 + 3) / 3 + 4) / 2)


def test_sequences_without_tokens_do_not_count():
    batch = with_weights({"mask_BxT": MASK.at[1].set(0.0)}, "seq_mean_token_sum")
    assert float(aggregate(X, batch)) == pytest.approx(6.0)


def test_kl_estimators_golden():
    logp, ref = jnp.array([[-1.0]]), jnp.array([[-1.5]])
    d = -0.5  # ref - logp
    assert float(kl_BxT(logp, ref, "k1")[0, 0]) == pytest.approx(0.5)
    assert float(kl_BxT(logp, ref, "k2")[0, 0]) == pytest.approx(0.125)
    assert float(kl_BxT(logp, ref, "k3")[0, 0]) == pytest.approx(np.exp(d) - 1 - d)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_BxT(logp, ref, "k4")


def test_kl_term_gradients_closed_form():
    logp = jnp.array([[-1.0, -2.0]])
    ref = jnp.array([[-1.5, -1.0]])
    batch = {"mask_BxT": jnp.ones((1, 2)), "ref_logp_BxT": ref}
    # k1: d/dlogp = 1/n; k2: (logp - ref)/n; k3: (1 - exp(ref - logp))/n.
    for est, expected in [("k1", [0.5, 0.5]), ("k2", (logp - ref) / 2),
                          ("k3", (1 - jnp.exp(ref - logp)) / 2)]:
        grad = jax.grad(lambda lp, e=est: kl_loss(lp, batch, kl_estimator=e)[0])(logp)
        np.testing.assert_allclose(grad, np.reshape(expected, (1, 2)), rtol=1e-5, err_msg=est)


def test_kl_to_go_resets_at_each_packed_sequence():
    kl = jnp.array([[1.0, 2.0, 3.0, 4.0, 5.0]])
    mask = jnp.array([[0.0, 1.0, 1.0, 1.0, 1.0]])  # position 0 is a prompt target
    unpacked = kl_to_go(kl, {"mask_BxT": mask})
    np.testing.assert_allclose(unpacked, [[14, 14, 12, 9, 5]])
    packed = kl_to_go(kl, {"mask_BxT": mask, "segment_ids_BxT": jnp.array([[1, 1, 1, 2, 2]])})
    np.testing.assert_allclose(packed, [[5, 5, 3, 9, 5]])


def test_entropy_term_is_a_bonus():
    batch = {"mask_BxT": jnp.ones((1, 2)), "entropy_BxT": jnp.array([[0.5, 1.5]])}
    loss, m = entropy_loss(jnp.zeros((1, 2)), batch)
    assert float(loss) == pytest.approx(-1.0) and float(m["entropy"]) == pytest.approx(1.0)
