"""A reward that is not a finite real number marks its trajectory invalid (None)."""

import jax.numpy as jnp
import numpy as np
import pytest

from fnrl.data.reward import checked_reward


@pytest.mark.parametrize("value, expected", [
    (1.0, 1.0), (0, 0.0), (-2.5, -2.5), (True, 1.0), (np.float32(0.5), 0.5),
    (np.int64(3), 3.0), (np.array(1.0), 1.0), (jnp.asarray(2.0), 2.0),
])
def test_finite_real_rewards_pass_as_floats(value, expected):
    reward = checked_reward(value)
    assert type(reward) is float and reward == expected


@pytest.mark.parametrize("value", [
    float("nan"), float("inf"), -float("inf"), np.float32("nan"), jnp.asarray(jnp.inf),
    None, "1.0", b"1", [1.0], np.array([1.0, 0.0]), {"reward": 1.0}, 1 + 1j, object(),
])
def test_non_finite_or_non_scalar_rewards_are_invalid(value):
    assert checked_reward(value) is None
