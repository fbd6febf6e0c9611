"""Advantage estimators, DAPO overlong shaping and dynamic sampling on tiny inputs."""

import numpy as np
import pytest

from fnrl.losses import ADVANTAGES
from fnrl.losses.advantages import overlong_penalty
from fnrl.policy.filtering import informative, select_groups

R = np.array([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])


def test_grpo_and_dr_grpo_golden():
    np.testing.assert_allclose(ADVANTAGES["grpo"](R, 0.0)[0], [1, -1, -1, 1], atol=1e-6)
    std = np.sqrt(0.5)
    np.testing.assert_allclose(ADVANTAGES["grpo"](R, 0.0)[1], [1 / std, -1 / std, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(ADVANTAGES["dr_grpo"](R), [[.5, -.5, -.5, .5], [1, -1, 0, 0]])


def test_rloo_is_leave_one_out():
    # r_i - mean of the other three: 1 - 1/3, 0 - 2/3, ...
    np.testing.assert_allclose(ADVANTAGES["rloo"](R)[0], [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6)
    np.testing.assert_allclose(ADVANTAGES["rloo"](R)[1], [4 / 3, -4 / 3, 0, 0], rtol=1e-6)


def test_reinforce_pp_whitens_over_the_batch():
    centred = R - R.mean(axis=1, keepdims=True)
    expected = (centred - centred.mean()) / centred.std()
    np.testing.assert_allclose(ADVANTAGES["reinforce_pp"](R, 0.0), expected, rtol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_invalid_samples_get_zero_and_do_not_move_the_baseline(name):
    with_nan = np.array([[1.0, 0.0, np.nan, 1.0, 0.0]])
    adv = ADVANTAGES[name](with_nan, 1e-6)
    assert adv[0, 2] == 0.0
    np.testing.assert_allclose(adv[0, [0, 1, 3, 4]], ADVANTAGES[name](with_nan[:, [0, 1, 3, 4]],
                                                                      1e-6)[0], rtol=1e-6)


def test_overlong_penalty_ramps_over_the_buffer():
    pen = overlong_penalty([4, 6, 7, 8, 9], max_len=8, buffer=4, factor=1.0)
    np.testing.assert_allclose(pen, [0.0, -0.5, -0.75, -1.0, -1.0])
    np.testing.assert_allclose(overlong_penalty([9], max_len=8, buffer=0), [0.0])


def test_dynamic_sampling_drops_zero_variance_and_keeps_the_batch_full():
    groups = [[1, 1], [0, 1], [0, 0], [1, 0], [None, 1], [0, 1]]
    assert not informative([None, 1]) and informative([0, 1])
    assert select_groups(groups, 2) == ((1, 3), (0, 2))
    # Only 3 informative groups exist: asking for 4 takes nothing, and says what to drop.
    assert select_groups(groups, 4) == ((), (0, 2, 4))
